"""One request against the server as a reliability client sees it: it ends in exactly one outcome
(``OUTCOMES``; their meaning and the promises: ``bench/reliability.py``), counted in a ``Tally``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from apt_serve_ray.bench.http_client import read_stream

OUTCOMES = ("completed", "cut", "rejected", "failed", "dropped", "lost", "bad_rejection")
PROMPT_LEN, MAX_TOKENS = 32, 64



# One request ----------------------------------------------------------------------------------------
@dataclass
class Result:
    outcome: str
    status: int | None = None
    ttft_s: float | None = None  # to the first streamed text
    latency_s: float = 0.0
    code: str | None = None  # the OpenAI error's code
    sent: float = 0.0  # when it was sent (monotonic)


@dataclass
class Tally:
    results: list[Result] = field(default_factory=list)

    def add(self, result: Result) -> None:
        self.results.append(result)

    def counts(self) -> dict[str, int]:
        counts = {o: 0 for o in OUTCOMES}
        for r in self.results:
            counts[r.outcome] += 1
        counts["sent"] = len(self.results)
        counts["accepted"] = sum(1 for r in self.results if r.status == 200)
        return counts


def _is_openai_error(payload) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and bool(error.get("message")) and {"type", "code"} <= set(error)


async def one_request(client, body: dict, timeout_s: float = 120.0, cut_after_chunks: int | None = None) -> Result:
    """Send one streaming completion (``client``: ``make_client``'s); with ``cut_after_chunks`` close
    the connection after that many events (the outcome is then ``cut``)."""
    import httpx

    start, seen = time.monotonic(), {}  # seen: the status, once the answer's headers came
    try:
        result = await asyncio.wait_for(_stream(client, body, start, cut_after_chunks, seen), timeout_s)
    except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException) as exc:
        result = Result("lost", seen.get("status"), latency_s=time.monotonic() - start, code=type(exc).__name__)
    except httpx.HTTPError as exc:
        result = Result("dropped", seen.get("status"), latency_s=time.monotonic() - start, code=type(exc).__name__)
    result.sent = start
    return result


async def _stream(client, body: dict, start: float, cut_after_chunks: int | None, seen: dict) -> Result:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        seen["status"] = r.status_code
        if r.status_code != 200:
            raw = await r.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            code = payload["error"].get("code") if _is_openai_error(payload) else None
            if r.status_code in (429, 503):
                ok = _is_openai_error(payload) and r.headers.get("retry-after", "").isdigit()
                return Result("rejected" if ok else "bad_rejection", r.status_code,
                              latency_s=time.monotonic() - start, code=code)
            return Result("failed", r.status_code, latency_s=time.monotonic() - start, code=code)
        read = await read_stream(r.aiter_bytes(), lambda: time.monotonic() - start, cut_after_chunks)
        ttft = read.token_times[0] if read.token_times else None
        latency = time.monotonic() - start
        if read.error is not None:
            return Result("failed", 200, ttft, latency, read.error_code)
        if read.cut:
            return Result("cut", 200, ttft, latency)
        if read.done and read.finish_reason is not None:
            return Result("completed", 200, ttft, latency)
        return Result("dropped", 200, ttft, latency, "stream ended without [DONE]")


def request_body(model: str, prompt_len: int, max_tokens: int, rng: random.Random) -> dict:
    return {"model": model, "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def make_client(base_url: str, headers: dict | None = None):
    import httpx

    return httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=httpx.Timeout(180.0),
                             limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))

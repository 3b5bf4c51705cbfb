"""The load side of ``benchmarks/reliability.py``: one request's outcome as the client sees it, the app's
processes and their memory, and the cluster's pages (loopback only).

Every request ends in exactly one outcome:

- ``completed``: 200 and the whole answer (a final ``finish_reason``; a stream ends with ``[DONE]``);
- ``rejected``: 429 or 503 *with* ``Retry-After`` and an OpenAI error body (a refusal the server
  promises; one without them is ``bad_rejection``);
- ``failed``: any other explicit error: a 4xx/5xx status, or a stream's error event;
- ``dropped``: the connection broke (a stream cut off without ``[DONE]``, a reset): the client
  knows at once that it failed, but gets no error body (Serve's proxy does this when the router
  replica holding the stream dies);
- ``lost``: no answer before the client's timeout: a hang. The promise is zero of these.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

OUTCOMES = ("completed", "cut", "rejected", "failed", "dropped", "lost", "bad_rejection")


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


async def one_request(client: httpx.AsyncClient, body: dict, timeout_s: float = 120.0,
                      cut_after_chunks: int | None = None) -> Result:
    """Send one streaming completion; with ``cut_after_chunks`` close the connection after that many
    events (the outcome is then ``cut``)."""
    start, seen = time.monotonic(), {}  # seen: the status, once the answer's headers came
    try:
        result = await asyncio.wait_for(_stream(client, body, start, cut_after_chunks, seen), timeout_s)
    except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException) as exc:
        result = Result("lost", seen.get("status"), latency_s=time.monotonic() - start, code=type(exc).__name__)
    except httpx.HTTPError as exc:
        result = Result("dropped", seen.get("status"), latency_s=time.monotonic() - start, code=type(exc).__name__)
    result.sent = start
    return result


async def _stream(client: httpx.AsyncClient, body: dict, start: float, cut_after_chunks: int | None,
                  seen: dict) -> Result:
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
        ttft, num_events, finished = None, 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if finished:
                    return Result("completed", 200, ttft, time.monotonic() - start)
                break
            payload = json.loads(data)
            if "error" in payload:
                return Result("failed", 200, ttft, time.monotonic() - start, payload["error"].get("code"))
            num_events += 1
            choice = payload["choices"][0] if payload.get("choices") else {}
            if ttft is None and choice.get("text"):
                ttft = time.monotonic() - start
            finished = finished or choice.get("finish_reason") is not None
            if cut_after_chunks is not None and num_events >= cut_after_chunks:
                return Result("cut", 200, ttft, time.monotonic() - start)
        return Result("dropped", 200, ttft, time.monotonic() - start, "stream ended without [DONE]")


def request_body(model: str, prompt_len: int, max_tokens: int, rng: random.Random) -> dict:
    return {"model": model, "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def make_client(base_url: str, headers: dict | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=httpx.Timeout(180.0),
                             limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))


# The app's processes --------------------------------------------------------------------------------
def app_processes(app: str, with_proxy: bool = False) -> list:
    """The app's Serve replica processes (router, controller, engine replicas: ``ray::ServeReplica:<app>:``)
    and their children (each engine replica's engine process); with ``with_proxy`` Serve's HTTP proxies."""
    import psutil

    found, prefixes = [], (f"ray::ServeReplica:{app}:",) + (("ray::ProxyActor",) if with_proxy else ())
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and cmdline[0].startswith(prefixes):
            found.append(proc)
            found.extend(proc.children(recursive=True))
    return found


def rss_bytes(app: str) -> int:
    """RSS of the app's processes and the HTTP proxy (which buffers what the routers refuse too)."""
    total = 0
    for proc in app_processes(app, with_proxy=True):
        try:
            total += proc.memory_info().rss
        except Exception:  # noqa: BLE001 - a process that ended between the listing and the read
            pass
    return total


def rss_by_role(app: str) -> dict[str, float]:
    """MiB per role: each deployment's replicas, their children (the engine processes) and the proxy."""
    roles: dict[str, float] = {}
    for proc in app_processes(app, with_proxy=True):
        try:
            name = proc.cmdline()[0]
            role = "proxy" if name.startswith("ray::ProxyActor") else (
                name.split(":")[4].split(".")[0] if name.startswith("ray::ServeReplica:") else "engine_process")
            roles[role] = round(roles.get(role, 0.0) + proc.memory_info().rss / 2**20, 1)
        except Exception:  # noqa: BLE001 - a process that ended between the listing and the read
            pass
    return roles


def open_files(app: str) -> int:
    total = 0
    for proc in app_processes(app):
        try:
            total += proc.num_fds()
        except Exception:  # noqa: BLE001
            pass
    return total


class Sampler:
    """RSS of the app's processes every ``interval_s`` in the background: peak and the series."""

    def __init__(self, app: str, interval_s: float = 0.5) -> None:
        self.app, self.interval_s, self.series = app, interval_s, []
        self._task: asyncio.Task | None = None

    async def __aenter__(self):
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()

    async def _run(self) -> None:
        start = time.monotonic()
        while True:
            rss = await asyncio.to_thread(rss_bytes, self.app)
            self.series.append((round(time.monotonic() - start, 2), rss))
            await asyncio.sleep(self.interval_s)

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.series), default=0)


# The cluster's state ------------------------------------------------------------------------------
def controller_state(app: str):
    from ray import serve

    return serve.get_deployment_handle("Controller", app).get_state.remote().result(timeout_s=10)


def pages_state(app: str) -> dict:
    """Free / total pages and running requests over the engine replicas (their last reports)."""
    loads = controller_state(app).replicas.values()
    return {"num_replicas": len(loads), "num_pages": sum(r.num_pages for r in loads),
            "num_free_pages": sum(r.num_free_pages for r in loads), "num_running": sum(r.num_running for r in loads),
            "num_waiting": sum(r.num_waiting for r in loads)}


async def wait_until_idle(app: str, base_url: str, headers: dict | None, num_replicas: int,
                          timeout_s: float = 60.0) -> float | None:
    """Seconds until every page is free, nothing runs and the router holds no slot; None on timeout."""
    start = time.monotonic()
    async with make_client(base_url, headers) as client:
        while time.monotonic() - start < timeout_s:
            try:
                pages = await asyncio.to_thread(pages_state, app)
                health = (await client.get("/health")).json()
                if (pages["num_replicas"] == num_replicas and pages["num_free_pages"] == pages["num_pages"]
                        and pages["num_running"] == pages["num_waiting"] == 0
                        and health.get("requests_in_flight") == 0 and health.get("requests_waiting") == 0):
                    return time.monotonic() - start
            except Exception:  # noqa: BLE001 - a controller or router being replaced: ask again
                pass
            await asyncio.sleep(0.25)
    return None

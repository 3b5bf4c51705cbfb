"""The serving benchmarks' HTTP client: one SSE parser for streamed OpenAI completions, one request
timed the way a user sees it, and the loops that send them: open loop (every request at its arrival
time, ``replay``), closed loop (a fixed number in flight, ``closed_loop``) and conversations (each
turn after the previous reply and a think time, ``run_sessions``).

Timing is on the client: a request's clock starts when it is sent, its first token is the first
streamed event that carries tokens (text, or token ids when asked for), and every later one is one
inter-token gap (a server streams one token per event unless it merges them). Token counts come from
the final usage event (``stream_options.include_usage``) when the server sends one. Prompts are token
ids (``"prompt": [ids]``), which both our server and vLLM accept, so prompt lengths are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from apt_serve_ray.bench.slo_metrics import RequestTimeline
from apt_serve_ray.bench.workloads import TraceRequest


@dataclass(frozen=True)
class StreamEvent:
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    is_done: bool = False
    error: str | None = None
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    cached_tokens: int | None = None
    error_code: str | None = None

    @property
    def has_tokens(self) -> bool:
        return bool(self.text or self.token_ids)


def feed_sse(pending: bytes, chunk: bytes) -> tuple[list[StreamEvent], bytes]:
    """Parse the complete SSE events in ``pending + chunk``; return them and the unconsumed bytes.

    Events end with a blank line; only ``data:`` lines matter (several in one event are joined by a
    newline, per the SSE spec). Bytes are decoded per complete event, so a read that splits an event
    or a multi-byte character is carried over to the next call.
    """
    *events, rest = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
    parsed = []
    for event in events:
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            parsed.append(parse_payload(b"\n".join(data).decode("utf-8")))
    return parsed, rest


def parse_payload(payload: str) -> StreamEvent:
    if payload.strip() == "[DONE]":
        return StreamEvent(is_done=True)
    data = json.loads(payload)
    if "error" in data:
        error = data["error"]
        if isinstance(error, dict):
            return StreamEvent(error=str(error.get("message", error)), error_code=error.get("code"))
        return StreamEvent(error=str(error))
    choices = data.get("choices") or []
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    ids = tuple(tok for c in choices for tok in (c.get("token_ids") or ()))
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return StreamEvent(text, usage.get("completion_tokens"), usage.get("prompt_tokens"), token_ids=ids,
                       finish_reason=finish, cached_tokens=cached)


@dataclass
class StreamRead:
    """What one streamed answer brought, times on the caller's clock."""

    token_times: list[float] = field(default_factory=list)  # events carrying tokens
    token_ids: list[int] = field(default_factory=list)
    num_events: int = 0  # data events other than [DONE] and errors
    last_event_s: float | None = None
    done_s: float | None = None  # when [DONE] came (the last event's time before it)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    cut: bool = False  # the caller stopped reading after ``cut_after_events``

    @property
    def done(self) -> bool:
        return self.done_s is not None


async def read_stream(chunks: AsyncIterator[bytes], clock: Callable[[], float],
                      cut_after_events: int | None = None) -> StreamRead:
    """Read an SSE body (any async iterator of bytes: aiohttp's ``content.iter_any()``, httpx's
    ``aiter_bytes()``) until ``[DONE]``, an error event, its end, or ``cut_after_events`` events."""
    r, pending = StreamRead(), b""
    async for chunk in chunks:
        now = clock()
        events, pending = feed_sse(pending, chunk)
        for e in events:
            if e.error is not None:
                r.error, r.error_code = e.error, e.error_code
                return r
            if e.is_done:
                r.done_s = r.last_event_s if r.last_event_s is not None else now
                return r
            r.num_events += 1
            r.last_event_s = now
            if e.has_tokens:
                r.token_times.append(now)
                r.token_ids.extend(e.token_ids)
            r.finish_reason = e.finish_reason or r.finish_reason
            for name in ("completion_tokens", "prompt_tokens", "cached_tokens"):
                if getattr(e, name) is not None:
                    setattr(r, name, getattr(e, name))
            if cut_after_events is not None and r.num_events >= cut_after_events:
                r.cut = True
                return r
    return r


# One request ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientOptions:
    """How requests are sent. ``request_fields``: what of a request's service level the server is
    told: ``priority`` (vLLM's field; its FCFS policy refuses a non-zero one) and ``slos`` (our
    extension fields ``ttft_slo_ms`` / ``tbt_slo_ms``; vLLM ignores them)."""

    ignore_eos: bool = True
    timeout: float = 600.0  # seconds per request
    max_concurrency: int | None = None
    disable_tqdm: bool = True
    request_fields: tuple[str, ...] = ("priority",)
    extra_body: dict | None = None
    return_token_ids: bool = False


def completion_body(model: str, prompt: list[int], max_tokens: int, opts: ClientOptions, *, priority: int = 0,
                    ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.return_token_ids:
        body["return_token_ids"] = True
    body.update(opts.extra_body or {})
    if priority and "priority" in opts.request_fields:
        body["priority"] = priority
    if "slos" in opts.request_fields:
        body.update({k: v for k, v in (("ttft_slo_ms", ttft_slo_ms), ("tbt_slo_ms", tbt_slo_ms)) if v is not None})
    return body


async def stream_into(http, url: str, body: dict, t: RequestTimeline, t0: float, timeout: float) -> StreamRead:
    """POST ``body`` (aiohttp session ``http``) and fill ``t`` (sent at ``t.arrival_s``) from the stream:
    first token, token times, finish, output tokens, or the error."""
    import aiohttp

    read = StreamRead()
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return read
            read = await read_stream(resp.content.iter_any(), lambda: time.perf_counter() - t0)
    except asyncio.TimeoutError:
        t.error = f"timeout after {timeout} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        t.error = f"{type(e).__name__}: {e}"
    t.token_times_s.extend(read.token_times)
    t.first_token_s = read.token_times[0] if read.token_times else None
    t.error = t.error or read.error
    if t.error is None:
        if read.done:
            t.finish_s = read.done_s
        else:
            t.error = "stream closed before 'data: [DONE]'"
    if read.prompt_tokens is not None:
        t.num_prompt_tokens = read.prompt_tokens
    t.num_output_tokens = (read.completion_tokens if read.completion_tokens is not None
                           else len(read.token_ids) or len(read.token_times))
    return read


async def send_request(http, url: str, req: TraceRequest, model: str, opts: ClientOptions,
                       slos: dict[str, float], t0: float) -> RequestTimeline:
    """One trace request, streamed and timed; its own SLOs take precedence over ``slos``."""
    body = completion_body(req.model or model, req.prompt_token_ids, req.output_len, opts, priority=req.priority,
                           ttft_slo_ms=req.ttft_slo_ms, tbt_slo_ms=req.tbt_slo_ms)
    own = {k: v for k, v in (("ttft_slo_ms", req.ttft_slo_ms), ("tbt_slo_ms", req.tbt_slo_ms)) if v is not None}
    t = RequestTimeline(req.request_id, time.perf_counter() - t0, None, [], None, req.prompt_len, 0,
                        **{**slos, **own})
    await stream_into(http, url, body, t, t0, opts.timeout)
    return t


# Loops ----------------------------------------------------------------------------------------------
def _session():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def replay(trace: list[TraceRequest], url: str, model: str, opts: ClientOptions, slos: dict[str, float],
                 on_start: Callable[[float], None] | None = None,
                 during: Callable[[float], Awaitable] | None = None) -> tuple[list[RequestTimeline], float]:
    """Open loop: send ``trace`` on its timing (at most ``opts.max_concurrency`` in flight, later ones
    waiting for a slot, as ``vllm bench serve`` does). Every time in the timelines is seconds since
    the start, which ``on_start`` receives as a ``time.perf_counter()`` reading (CLOCK_MONOTONIC on
    Linux, the clock a server's ``time.monotonic`` reads, to line its records up with these).
    ``during(t0)``: a coroutine run beside the requests (e.g. polling the server), cancelled after."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(trace), disable=opts.disable_tqdm)
    async with _session() as http:
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)
        side = asyncio.create_task(during(t0)) if during is not None else None

        async def one(req: TraceRequest) -> RequestTimeline:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
            async with limit:
                timeline = await send_request(http, url, req, model, opts, slos, t0)
            bar.update(1)
            return timeline

        timelines = await asyncio.gather(*(one(r) for r in trace))
        duration = time.perf_counter() - t0
        if side is not None:
            side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
    bar.close()
    return list(timelines), duration


async def closed_loop(num_requests: int, concurrency: int, send: Callable[[int], Awaitable]) -> list:
    """Closed loop: ``concurrency`` requests always in flight, the next one sent as one ends, until
    ``num_requests`` were sent; ``send(i)``'s results in the order they ended."""
    queue, results = list(range(num_requests)), []

    async def worker() -> None:
        while queue:
            results.append(await send(queue.pop(0)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_sessions(sessions, url: str, model: str, opts: ClientOptions):
    """Conversations (``bench.conversations.Session``), each turn sent after the previous reply and a
    think time, the history re-sent with the reply's own token ids. Returns one record per request,
    ``(session, turn, timeline, cached tokens reported)``, and the duration. A turn that fails ends
    its conversation, as a user's would."""
    opts = dataclasses.replace(opts, return_token_ids=True)
    records = []
    async with _session() as http:
        t0 = time.perf_counter()

        async def one(s) -> None:
            await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
            history = list(s.prefix)
            for turn, (message, out) in enumerate(zip(s.messages, s.output_lens)):
                prompt = history + message
                c = s.service
                body = completion_body(model, prompt, out, opts, priority=c.priority, ttft_slo_ms=c.ttft_slo_ms,
                                       tbt_slo_ms=c.tbt_slo_ms)
                t = RequestTimeline(s.session_id, time.perf_counter() - t0, None, [], None, len(prompt), 0,
                                    ttft_slo_ms=c.ttft_slo_ms, tbt_slo_ms=c.tbt_slo_ms)
                read = await stream_into(http, url, body, t, t0, opts.timeout)
                t.num_prompt_tokens = len(prompt)
                records.append((s, turn, t, read.cached_tokens))
                if t.error is not None:
                    return
                history = prompt + read.token_ids
                if turn < len(s.think_s):
                    await asyncio.sleep(s.think_s[turn])

        await asyncio.gather(*(one(s) for s in sessions))
        duration = time.perf_counter() - t0
    return records, duration


async def first_model(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


async def warm_up(url: str, model: str, num: int = 2, timeout: float = 300.0) -> None:
    """``num`` short requests, not streamed, off the clock (first-call allocations, compilation)."""
    import aiohttp

    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0.0}
    async with aiohttp.ClientSession() as http:
        for _ in range(num):
            async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                resp.raise_for_status()
                await resp.read()

"""The serving benchmarks' HTTP client: SSE parsing, one stream read, and the loops against a small
loopback server that streams like ours (SSE, usage, ``[DONE]``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from apt_serve_ray.bench.http_client import (ClientOptions, closed_loop, completion_body, feed_sse, read_stream,
                                             replay, run_sessions)
from apt_serve_ray.bench.slo_metrics import parse_goodput
from apt_serve_ray.bench.workloads import TraceRequest

STREAM = (
    'data: {"id":"c1","choices":[{"index":0,"text":"Caf\u00e9"}]}\n\n'
    'data: {"id":"c1","choices":[{"index":0,"text":" au"}]}\r\n\r\n'
    ': a keep-alive comment\n\n'
    'data: {"id":"c1","choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
    'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
    'data: [DONE]\n\n'
).encode("utf-8")


@pytest.mark.parametrize("read_size", [len(STREAM), 7, 1])
def test_sse_parse_handles_split_reads_usage_and_done(read_size):
    events, pending = [], b""
    for start in range(0, len(STREAM), read_size):  # reads split events, CRLFs and the 2-byte 'é'
        new, pending = feed_sse(pending, STREAM[start:start + read_size])
        events.extend(new)
    assert pending == b""
    assert [e.text for e in events] == ["Caf\u00e9", " au", "", "", ""]
    assert events[2].finish_reason == "length" and not events[2].has_tokens
    assert events[3].completion_tokens == 3 and events[3].prompt_tokens == 5
    assert [e.is_done for e in events] == [False, False, False, False, True]


def test_sse_token_ids_cached_tokens_and_errors():
    (event,), _ = feed_sse(b"", b'data: {"choices":[{"text":"","token_ids":[7,8]}],'
                                b'"usage":{"prompt_tokens_details":{"cached_tokens":32}}}\n\n')
    assert event.has_tokens and event.token_ids == (7, 8) and event.cached_tokens == 32
    (event,), _ = feed_sse(b"", b'data: {"error": {"message": "prompt too long", "code": "too_long"}}\n\n')
    assert event.error == "prompt too long" and event.error_code == "too_long"
    (event,), _ = feed_sse(b"", b'data: {"error": "plain"}\n\n')
    assert event.error == "plain" and event.error_code is None


def test_goodput_flags():
    assert parse_goodput(["ttft:4000", "itl:500", "tpot:80"]) == {
        "ttft_slo_ms": 4000.0, "tbt_slo_ms": 500.0, "tpot_slo_ms": 80.0}
    with pytest.raises(ValueError, match="ttft"):
        parse_goodput(["ttfb:100"])
    with pytest.raises(ValueError, match="> 0"):
        parse_goodput(["ttft:0"])


async def _chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_read_stream_times_tokens_and_stops_where_asked():
    clock = iter(range(100)).__next__  # one tick per chunk read
    read = asyncio.run(read_stream(_chunks(STREAM, 1_000), lambda: float(clock())))
    assert read.done and read.token_times == [0.0, 0.0] and read.finish_reason == "length"
    assert read.completion_tokens == 3 and read.num_events == 4
    cut = asyncio.run(read_stream(_chunks(STREAM, 1_000), lambda: 0.0, cut_after_events=2))
    assert cut.cut and not cut.done and cut.num_events == 2
    broken = asyncio.run(read_stream(_chunks(STREAM[:60], 7), lambda: 0.0))
    assert not broken.done and not broken.cut and broken.error is None


def test_completion_body_tells_a_server_only_what_it_is_told_to():
    plain = completion_body("m", [1, 2], 4, ClientOptions(request_fields=()), priority=3, ttft_slo_ms=100.0)
    assert "priority" not in plain and "ttft_slo_ms" not in plain and plain["ignore_eos"] is True
    told = completion_body("m", [1, 2], 4, ClientOptions(request_fields=("priority", "slos"), extra_body={"x": 1}),
                           priority=3, ttft_slo_ms=100.0, tbt_slo_ms=None)
    assert told["priority"] == 3 and told["ttft_slo_ms"] == 100.0 and "tbt_slo_ms" not in told and told["x"] == 1


# Against a loopback server ------------------------------------------------------------------------
@pytest.fixture
def server():
    """A server that streams ``max_tokens`` tokens (one event each, token ids = prompt length + i),
    reports usage and cached tokens (the prompt tokens it saw before), then [DONE]; it records the
    bodies it got. Refuses prompts containing 0 with HTTP 400."""
    aiohttp_web = pytest.importorskip("aiohttp.web")
    seen, bodies = set(), []

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        prompt = body["prompt"]
        if 0 in prompt:
            return aiohttp_web.Response(status=400, text="bad prompt")
        resp = aiohttp_web.StreamResponse()
        await resp.prepare(request)
        cached = sum(1 for i in range(len(prompt)) if tuple(prompt[:i + 1]) in seen)
        seen.update(tuple(prompt[:i + 1]) for i in range(len(prompt)))
        for i in range(body["max_tokens"]):
            choice = {"index": 0, "text": f"t{i}", "token_ids": [len(prompt) + i]}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.002)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def start():
        app = aiohttp_web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = aiohttp_web.AppRunner(app)
        await runner.setup()
        site = aiohttp_web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    return start, bodies


def test_open_loop_replay_times_every_request_and_reports_errors(server):
    start, bodies = server
    trace = [TraceRequest(f"r{i}", 0.05 * i, 3, 4, [1 + i, 2, 3], ttft_slo_ms=500.0, priority=i % 2)
             for i in range(4)] + [TraceRequest("bad", 0.0, 2, 2, [0, 1])]

    async def go():
        runner, port = await start()
        try:
            return await replay(trace, f"http://127.0.0.1:{port}/v1/completions", "m",
                                ClientOptions(request_fields=("priority",)), {"tbt_slo_ms": 1000.0})
        finally:
            await runner.cleanup()

    timelines, duration = asyncio.run(go())
    ok = {t.request_id: t for t in timelines if t.error is None}
    assert set(ok) == {"r0", "r1", "r2", "r3"} and duration > 0.15
    for t in ok.values():
        assert len(t.token_times_s) == 4 and t.num_output_tokens == 4 and t.is_finished
        assert t.first_token_s >= t.arrival_s and t.ttft_slo_ms == 500.0 and t.tbt_slo_ms == 1000.0
    assert ok["r3"].arrival_s >= 0.15  # sent at its arrival time, not at once
    bad = next(t for t in timelines if t.request_id == "bad")
    assert bad.error.startswith("HTTP 400") and not bad.is_finished
    assert [b.get("priority") for b in bodies if b["prompt"] != [0, 1]].count(1) == 2


def test_sessions_resend_their_history_and_closed_loop_keeps_the_limit(server):
    from apt_serve_ray.bench.conversations import ConversationSpec, make_sessions
    from apt_serve_ray.bench.workloads import Uniform

    start, bodies = server
    spec = ConversationSpec(num_sessions=2, chat_share=1.0, turns=Uniform(2, 2), think_s=0.01, vocab_size=1000)
    sessions = make_sessions(spec, 50.0, seed=3)
    for s in sessions:
        s.output_lens[:] = [3] * len(s.output_lens)

    async def go():
        runner, port = await start()
        try:
            records, _ = await run_sessions(sessions, f"http://127.0.0.1:{port}/v1/completions", "m", ClientOptions())
            in_flight, peak = [0], [0]

            async def one(i):
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
                await asyncio.sleep(0.01)
                in_flight[0] -= 1
                return i

            done = await closed_loop(7, 3, one)
            return records, done, peak[0]
        finally:
            await runner.cleanup()

    records, done, peak = asyncio.run(go())
    assert sorted(done) == list(range(7)) and peak == 3
    assert len(records) == 4 and all(t.error is None for _, _, t, _ in records)
    for s in sessions:
        opening = s.prefix + s.messages[0]
        first, second = [b["prompt"] for b in bodies if b["prompt"][:len(opening)] == opening][:2]
        reply = [len(first) + i for i in range(3)]  # the token ids the server streamed
        assert second == first + reply + s.messages[1]  # the history re-sent with the reply's own ids
    for s, turn, _, cached in records:  # what the server said it had cached: at least the first turn
        assert cached >= (len(s.prefix) + len(s.messages[0]) if turn == 1 else 0)


def test_engine_replay_times_the_same_trace_in_process(opt_tiny):
    """peer_sweep.py --start engine: the trace through an AsyncLLMEngine here gives the timelines the HTTP
    client would (first token, a time per delta, output tokens, finish) and the same summary."""
    import asyncio

    from apt_serve_ray import AsyncLLMEngine
    from apt_serve_ray.bench import slo_metrics, workloads
    from apt_serve_ray.bench.engine_client import replay_engine
    from apt_serve_ray.bench.http_client import ClientOptions
    from apt_serve_ray.config import EngineConfig

    trace = workloads.fill_token_ids(workloads.make_random_trace(3, float("inf"), 12, 5, 0.1, seed=1), 100, 1)
    engine = AsyncLLMEngine(EngineConfig(model=opt_tiny, engine_process=False, dtype="float32", num_pages=64))
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        timelines, duration = loop.run_until_complete(replay_engine(trace, engine, ClientOptions(max_concurrency=2), {}))
    finally:
        engine.shutdown()
        loop.close()
    assert [t.error for t in timelines] == [None, None, None]
    for t, req in zip(timelines, trace):
        assert t.num_output_tokens == req.output_len and t.first_token_s is not None
        assert t.arrival_s <= t.first_token_s <= t.token_times_s[-1] <= t.finish_s <= duration
    assert slo_metrics.summarize(timelines, duration)["completed"] == 3

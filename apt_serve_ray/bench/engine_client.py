"""The benchmark client's loop against an ``AsyncLLMEngine`` in this process: the same trace, timelines and
metrics as ``http_client.replay``, without the Serve app or HTTP in between. Beside a run through the server,
it tells the engine's own speed from what the serving path costs (issue 41)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from apt_serve_ray.bench.http_client import ClientOptions
from apt_serve_ray.bench.slo_metrics import RequestTimeline
from apt_serve_ray.bench.workloads import TraceRequest


async def replay_engine(trace: list[TraceRequest], engine, opts: ClientOptions,
                        slos: dict[str, float]) -> tuple[list[RequestTimeline], float]:
    """Open loop, as ``http_client.replay``: each request at its arrival time (at most
    ``opts.max_concurrency`` in flight), greedy, ``req.output_len`` tokens (EOS ignored where
    ``opts.ignore_eos``); a time per output delta that carries tokens, as the HTTP client takes one
    per stream event."""
    from apt_serve_ray import SamplingParams

    limit = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else contextlib.nullcontext()
    t0 = time.perf_counter()

    async def one(req: TraceRequest) -> RequestTimeline:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
        async with limit:
            own = {k: v for k, v in (("ttft_slo_ms", req.ttft_slo_ms), ("tbt_slo_ms", req.tbt_slo_ms)) if v is not None}
            t = RequestTimeline(req.request_id, time.perf_counter() - t0, None, [], None, req.prompt_len, 0,
                                **{**slos, **own})
            params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=opts.ignore_eos)
            try:
                async for out in engine.generate(req.prompt_token_ids, params, request_id=req.request_id,
                                                 priority=req.priority):
                    if out.outputs[0].token_ids:
                        t.token_times_s.append(time.perf_counter() - t0)
                    t.num_output_tokens = out.num_output_tokens
                    if out.finished:
                        t.finish_s = time.perf_counter() - t0
            except (ValueError, RuntimeError) as exc:
                t.error = f"{type(exc).__name__}: {exc}"
            t.first_token_s = t.token_times_s[0] if t.token_times_s else None
            if t.error is None and t.finish_s is None:
                t.error = "the stream ended without a finished output"
            return t

    timelines = await asyncio.gather(*(one(r) for r in trace))
    return list(timelines), time.perf_counter() - t0

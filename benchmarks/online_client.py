"""Replay a request trace against an OpenAI-compatible ``/v1/completions`` endpoint and report SLO metrics.

Works the same against our Ray Serve app and a vLLM server, with flags mirroring ``vllm bench serve``::

    python benchmarks/online_client.py --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 384 --random-output-len 128 --random-range-ratio 0.9 --ignore-eos \\
        --num-prompts 200 --request-rate 0.5 --goodput ttft:4000 tbt:500

Timing is on the client: a request's clock starts when it is sent (after waiting for
``--max-concurrency``, as in vLLM), its first token is the first streamed chunk with text, and every
later chunk with text is one inter-token gap (vLLM streams one token per chunk). Token counts come
from the final usage chunk (``stream_options.include_usage``) when the server sends one. Prompts
are token ids (``"prompt": [ids]``), which both servers accept, so prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tqdm import tqdm

# Run as a script from a checkout: make the repository importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apt_serve_ray.bench import slo_metrics, workloads  # noqa: E402
from apt_serve_ray.bench.slo_metrics import RequestTimeline  # noqa: E402
from apt_serve_ray.bench.workloads import TraceRequest  # noqa: E402

GOODPUT_KEYS = {"ttft": "ttft_slo_ms", "tpot": "tpot_slo_ms", "e2el": "e2el_slo_ms",
                "itl": "tbt_slo_ms", "tbt": "tbt_slo_ms"}


@dataclass(frozen=True)
class StreamEvent:
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    is_done: bool = False
    error: str | None = None


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
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict) else error))
    choices = data.get("choices") or []
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    usage = data.get("usage") or {}
    return StreamEvent(text, usage.get("completion_tokens"), usage.get("prompt_tokens"))


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:4000", "tbt:500"]`` -> ``{"ttft_slo_ms": 4000.0, "tbt_slo_ms": 500.0}``."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: {name!r} is not one of {sorted(GOODPUT_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not NAME:MILLISECONDS") from None
        if not ms > 0:
            raise ValueError(f"--goodput: {item!r} needs a value > 0")
        slos[GOODPUT_KEYS[name]] = ms
    return slos


async def send_request(session: aiohttp.ClientSession, url: str, req: TraceRequest, model: str,
                       args: argparse.Namespace, slos: dict[str, float], t0: float) -> RequestTimeline:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(getattr(args, "extra_body", None) or {})
    # What of the request's service level the server is told: its priority (vLLM's field; its FCFS
    # policy refuses a non-zero one) and its SLOs (our extension fields; vLLM ignores them).
    told = getattr(args, "request_fields", ("priority",))
    if req.priority and "priority" in told:
        body["priority"] = req.priority
    if "slos" in told:
        body.update({k: v for k, v in (("ttft_slo_ms", req.ttft_slo_ms), ("tbt_slo_ms", req.tbt_slo_ms))
                     if v is not None})
    own = {"ttft_slo_ms": req.ttft_slo_ms, "tbt_slo_ms": req.tbt_slo_ms}
    t = RequestTimeline(req.request_id, time.perf_counter() - t0, None, [], None, req.prompt_len, 0,
                        **{**slos, **{k: v for k, v in own.items() if v is not None}})
    completion_tokens = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=args.timeout)) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return t
            pending, last_event_s = b"", None
            async for chunk in resp.content.iter_any():
                now = time.perf_counter() - t0
                events, pending = feed_sse(pending, chunk)
                for event in events:
                    if event.error is not None:
                        t.error = event.error
                        return t
                    if event.is_done:
                        t.finish_s = last_event_s if last_event_s is not None else now
                        break
                    last_event_s = now
                    if event.text:
                        t.first_token_s = now if t.first_token_s is None else t.first_token_s
                        t.token_times_s.append(now)
                    if event.completion_tokens is not None:
                        completion_tokens = event.completion_tokens
                    if event.prompt_tokens is not None:
                        t.num_prompt_tokens = event.prompt_tokens
                if t.finish_s is not None:
                    break
            if t.finish_s is None:
                t.error = "stream closed before 'data: [DONE]'"
    except asyncio.TimeoutError:
        t.error = f"timeout after {args.timeout} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        t.error = f"{type(e).__name__}: {e}"
    t.num_output_tokens = completion_tokens if completion_tokens is not None else len(t.token_times_s)
    return t


async def replay(trace: list[TraceRequest], url: str, model: str, args: argparse.Namespace,
                 slos: dict[str, float], on_start=None) -> tuple[list[RequestTimeline], float]:
    """Send ``trace`` on its timing; every time in the timelines is seconds since the start, which
    ``on_start`` (if given) receives as a ``time.perf_counter()`` reading (CLOCK_MONOTONIC on Linux,
    the clock a server's ``time.monotonic`` reads, to line its records up with these)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(trace), disable=args.disable_tqdm)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)

        async def one(req: TraceRequest) -> RequestTimeline:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
            async with limit:
                timeline = await send_request(session, url, req, model, args, slos, t0)
            bar.update(1)
            return timeline

        timelines = await asyncio.gather(*(one(r) for r in trace))
        duration = time.perf_counter() - t0
    bar.close()
    return list(timelines), duration


async def first_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


def build_trace(args: argparse.Namespace) -> list[TraceRequest]:
    cv = 1.0 / math.sqrt(args.burstiness)
    rate = math.inf if args.request_rate is None else args.request_rate
    if args.trace:
        trace = workloads.load_trace(args.trace)
        if args.request_rate is not None:
            trace = workloads.with_rate(trace, rate, cv, args.seed)
    elif args.dataset_name == "random":
        trace = workloads.make_random_trace(args.num_prompts, rate, args.random_input_len, args.random_output_len,
                                            args.random_range_ratio, cv, args.seed, args.max_model_len)
    else:
        trace = workloads.make_trace(args.dataset_name, args.num_prompts, rate, cv, args.seed, args.max_model_len)
    return workloads.fill_token_ids(trace, args.vocab_size, args.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--dataset-name", default="random", choices=sorted(workloads.WORKLOADS))
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=None,
                   help="req/s; inf sends all at once (default: inf, or the timing of --trace)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps = 1/cv^2; 1 is Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=49152, help="range of random prompt token ids")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="fields added to every request body, e.g. '{\"presence_penalty\": 0.5}'")
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs ttft, tpot, e2el, and itl/tbt (P99 of a request's token gaps); "
                        "a trace request's own SLOs take precedence")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead of generating one")
    p.add_argument("--save-trace", default=None, help="write the trace that is replayed as JSONL")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if not args.burstiness > 0:
        p.error("--burstiness must be > 0")
    if args.request_rate is not None and not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    try:
        args.slos = parse_goodput(args.goodput)
        args.metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        slo_metrics.format_summary(slo_metrics.summarize([], 1.0), args.metrics)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base_url = args.base_url.rstrip("/")
    try:
        trace = build_trace(args)
        model = args.model or asyncio.run(first_model(base_url))
    except (ValueError, OSError, aiohttp.ClientError) as e:
        sys.exit(f"error: {e}")
    if args.save_trace:
        workloads.save_trace(trace, args.save_trace)
    print(f"{len(trace)} requests to {base_url}{args.endpoint} (model {model}); rate "
          f"{args.request_rate or 'inf'} req/s, burstiness {args.burstiness}, "
          f"max concurrency {args.max_concurrency}, SLOs {args.slos or 'none'}")
    timelines, duration = asyncio.run(replay(trace, base_url + args.endpoint, model, args, args.slos))
    summary = slo_metrics.summarize(timelines, duration)
    print(slo_metrics.format_summary(summary, args.metrics))
    errors = [t.error for t in timelines if t.error]
    if errors:
        print(f"{len(errors)} errors; first: {errors[0]}")
    if args.save_result:
        name = args.result_filename or (
            f"online-{args.dataset_name}-{args.request_rate or 'inf'}qps-{time.strftime('%Y%m%d-%H%M%S')}.json")
        config = {k: v for k, v in vars(args).items() if k not in ("slos", "metrics")}
        result = {"model_id": model, "date": time.strftime("%Y%m%d-%H%M%S"), **config, **summary,
                  "slos": args.slos, "requests": [dataclasses.asdict(t) for t in timelines]}
        Path(name).write_text(json.dumps(result, indent=1))
        print(f"result written to {name}")


if __name__ == "__main__":
    main()

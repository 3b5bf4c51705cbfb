"""Replay a request trace against an OpenAI-compatible ``/v1/completions`` endpoint and report SLO metrics.

Works the same against our Ray Serve app and a vLLM server, with flags mirroring ``vllm bench serve``::

    python benchmarks/online_client.py --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 384 --random-output-len 128 --random-range-ratio 0.9 --ignore-eos \\
        --num-prompts 200 --request-rate 0.5 --goodput ttft:4000 tbt:500

Timing is on the client (``apt_serve_ray/bench/http_client.py``): a request's clock starts when it is
sent (after waiting for ``--max-concurrency``, as in vLLM), its first token is the first streamed
chunk with text, and every later one is an inter-token gap; token counts come from the final usage
chunk. Prompts are token ids, so prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import aiohttp

from apt_serve_ray.bench import slo_metrics, workloads
from apt_serve_ray.bench.http_client import ClientOptions, first_model, replay
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.slo_metrics import parse_goodput

def build_trace(args: argparse.Namespace) -> list[workloads.TraceRequest]:
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
    opts = ClientOptions(ignore_eos=args.ignore_eos, timeout=args.timeout, max_concurrency=args.max_concurrency,
                         disable_tqdm=args.disable_tqdm, extra_body=args.extra_body)
    timelines, duration = asyncio.run(replay(trace, base_url + args.endpoint, model, opts, args.slos))
    summary = slo_metrics.summarize(timelines, duration)
    print(slo_metrics.format_summary(summary, args.metrics))
    errors = [t.error for t in timelines if t.error]
    if errors:
        print(f"{len(errors)} errors; first: {errors[0]}")
    if args.save_result:
        name = args.result_filename or (
            f"online-{args.dataset_name}-{args.request_rate or 'inf'}qps-{time.strftime('%Y%m%d-%H%M%S')}.json")
        config = {k: v for k, v in vars(args).items() if k not in ("slos", "metrics")}
        header = stamp(threads=None, dtype=None, model=model, simulated=False, base_url=base_url)
        result = {"model_id": model, "date": time.strftime("%Y%m%d-%H%M%S"), **config, **summary,
                  "slos": args.slos, "requests": [dataclasses.asdict(t) for t in timelines]}
        write_json(Path(name), result, header)
        print(f"result written to {name}")


if __name__ == "__main__":
    main()

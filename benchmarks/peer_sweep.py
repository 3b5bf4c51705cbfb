"""Rate sweep against one OpenAI-compatible server, for comparing servers on the same traces.

    python benchmarks/peer_sweep.py --base-url http://127.0.0.1:8100 --label vllm \\
        --json docs/benchmarks/peer/peer_sweep.json --out-dir docs/benchmarks/peer

One server per run, already up (``--base-url``) or started and stopped here (``--start``: what
``vllm_compare.sh`` does); each run adds its label to the JSON and the table holds every label, with
ratios against ``--baseline``. The traces are ``serving_policies.py``'s, with token ids of their own at
every rate; ``--probe`` adds single-stream TTFT / TPOT and saturated tokens/s. Higher rates are skipped
once attainment falls below ``--stop-below``. Results: docs/benchmarks.md ("Engine speed against vLLM").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

import aiohttp

from apt_serve_ray.bench import plots, servers, slo_metrics, workloads
from apt_serve_ray.bench.engine_args import COMMON, PEER_MATCHED, Default, add_cache_dir, add_engine_args, engine_kwargs, \
    random_checkpoint
from apt_serve_ray.bench.http_client import ClientOptions, first_model, replay, warm_up
from apt_serve_ray.bench.report import stamp, write_json

DEFAULT_RATES = {"sharegpt": (0.5, 1.0, 1.5, 2.0, 3.0), "longbench": (0.15, 0.3, 0.45, 0.6, 0.9)}


def base_trace(workload: str, args) -> list[workloads.TraceRequest]:
    base = workloads.make_trace(workload, args.num_requests, 1.0, cv=args.cv, seed=args.seed,
                                max_model_len=args.max_model_len, max_output_len=args.max_output_len)
    return workloads.fill_token_ids(base, args.vocab_size, args.seed)


def sweep(workload: str, url: str, model: str, args) -> dict:
    base = base_trace(workload, args)
    rates = sorted(getattr(args, f"rates_{workload}") or args.rates or DEFAULT_RATES[workload])
    slos = {"ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms}
    client = ClientOptions(timeout=args.timeout, disable_tqdm=args.disable_tqdm)
    print(f"\n== {args.label} {workload}: {len(base)} requests, prompt mean "
          f"{statistics.mean(r.prompt_len for r in base):.0f}, output mean "
          f"{statistics.mean(r.output_len for r in base):.0f} tokens; SLO TTFT {args.ttft_slo_ms:.0f} ms, "
          f"P99 gap {args.tbt_slo_ms:.0f} ms", flush=True)
    runs = []
    for rate in rates:
        trace = workloads.fresh_ids(workloads.with_rate(base, rate, cv=args.cv, seed=args.seed), args.vocab_size,
                                    args.seed, rate, run=workload)
        timelines, duration = asyncio.run(replay(trace, url, model, client, slos))
        s = slo_metrics.summarize(timelines, duration)
        errors = [t.error for t in timelines if t.error]
        runs.append({"rate": rate, "summary": s, "errors": errors[:5], "num_errors": len(errors)})
        print(f"  {rate:5.2f} req/s attain {100 * s['slo_attainment']:5.1f}%  ok {s['completed']:3d} "
              f"failed {s['failed']:2d}  ttft mean {s['mean_ttft_ms']:6.0f} p99 {s['p99_ttft_ms']:6.0f}  "
              f"itl median {s['median_itl_ms']:5.0f} p99 {s['p99_itl_ms']:5.0f} ms  "
              f"out {s['output_throughput']:5.1f} tok/s  {duration:4.0f}s"
              + (f"  first error: {errors[0][:120]}" if errors else ""), flush=True)
        if s["slo_attainment"] < args.stop_below:
            break
    points = [(r["rate"], r["summary"]["slo_attainment"]) for r in runs]
    return {"rates": [r for r, _ in points], "attainment": points, "runs": runs,
            "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms},
            "effective_throughput": slo_metrics.effective_at(points),
            "trace": {"num_requests": len(base), "prompt_lens": [r.prompt_len for r in base],
                      "output_lens": [r.output_len for r in base]}}


def probe(url: str, model: str, args, run=None) -> dict:
    """Single-stream latency (concurrency 1) and saturated throughput (everything at once). ``run(trace,
    client)``: how a trace is sent (default: over HTTP to ``url``) -> (timelines, duration)."""
    result = {"input_len": args.probe_input_len, "output_len": args.probe_output_len}
    for name, num, concurrency in (("single", args.probe_single, 1), ("saturated", args.probe_saturated, None)):
        trace = workloads.make_random_trace(num, math.inf, args.probe_input_len, args.probe_output_len, 0.1,
                                            seed=args.seed + 1, max_model_len=args.max_model_len)
        # Each phase its own prompts: the saturated one had repeated the single one's eight (prefix-cache hits).
        trace = workloads.fresh_ids(trace, args.vocab_size, args.seed + 1, 0.0, run=f"probe-{name}")
        client = ClientOptions(timeout=args.timeout, max_concurrency=concurrency)
        timelines, duration = (run(trace, client) if run is not None
                               else asyncio.run(replay(trace, url, model, client, {})))
        s = slo_metrics.summarize(timelines, duration)
        result[name] = {k: s[k] for k in ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms",
                                          "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                                          "median_itl_ms", "p99_itl_ms", "total_output_tokens")}
        print(f"  probe {name:9s} ({num} requests, concurrency {concurrency or num}): ttft median "
              f"{s['median_ttft_ms']:6.0f} ms  tpot median {s['median_tpot_ms']:6.1f} ms  itl median "
              f"{s['median_itl_ms']:6.1f} p99 {s['p99_itl_ms']:6.0f} ms  out {s['output_throughput']:6.1f} tok/s"
              + (f"  failed {s['failed']}" if s["failed"] else ""), flush=True)
    return result


def print_probe_table(report: dict, baseline: str | None) -> None:
    servers = {label: s["probe"] for label, s in report["servers"].items() if s.get("probe")}
    if not servers:
        return
    print("\nEngine speed through the server (client side)")
    print(f"  {'server':24s} {'TTFT c=1':>9s} {'TPOT c=1':>9s} {'tok/s sat':>10s} {'ITL sat':>8s}")
    base = servers.get(baseline)
    for label, p in servers.items():
        one, sat = p["single"], p["saturated"]
        ratio = ""
        if base is not None and label != baseline:
            ratio = (f"   TPOT {one['median_tpot_ms'] / base['single']['median_tpot_ms']:.2f}x, "
                     f"tok/s {sat['output_throughput'] / base['saturated']['output_throughput']:.2f}x of {baseline}")
        print(f"  {label:24s} {one['median_ttft_ms']:7.0f}ms {one['median_tpot_ms']:7.1f}ms "
              f"{sat['output_throughput']:10.1f} {sat['median_itl_ms']:6.0f}ms{ratio}")


def print_table(report: dict, baseline: str | None) -> None:
    print("\nEffective throughput (req/s): highest rate with SLO attainment >= 90% / >= 60%")
    names = {w for s in report["servers"].values() for w in s["workloads"]}
    for workload in sorted(names):
        print(f"\n{workload}")
        print(f"  {'server':24s} {'@90%':>7s} {'@60%':>7s}   attainment % per rate")
        base = report["servers"].get(baseline, {}).get("workloads", {}).get(workload)
        for label, server in report["servers"].items():
            w = server["workloads"].get(workload)
            if w is None:
                continue
            e = w["effective_throughput"]
            att = " ".join(f"{r:g}:{100 * a:.0f}" for r, a in w["attainment"])
            ratio = ""
            if base is not None and label != baseline:
                ratio = "  vs " + baseline + ": " + " / ".join(
                    slo_metrics.format_ratio(e[t], base["effective_throughput"][t]) for t in ("90", "60"))
            print(f"  {label:24s} {e['90']:7.3f} {e['60']:7.3f}   {att}{ratio}")


def served_checkpoint(args) -> str:
    """--checkpoint (a local folder, e.g. one quantize_checkpoint.py wrote), else --shape's random checkpoint."""
    return args.checkpoint or random_checkpoint(args.shape, args.cache_dir)


def start_spec(args) -> servers.ServerSpec:
    ckpt, engine, extra = served_checkpoint(args), engine_kwargs(args), shlex.split(args.server_args)
    if args.start == "ours":
        engine.setdefault("policy", "apt")  # --policy: another of ours against the same peer
        engine.update(light_watermark=1.0, heavy_watermark=1.0, default_ttft_slo_ms=args.ttft_slo_ms,
                      default_tbt_slo_ms=args.tbt_slo_ms)
        return servers.ours(engine, model=ckpt, served_model_name=args.shape, extra=extra)
    return servers.named(args.start, engine, model=ckpt, served_model_name=args.shape, vllm_args=extra, kv_cache_gib=2)


def engine_config(args):
    """--start engine: the EngineConfig the Serve app would give its replica for --start ours."""
    sys.path.insert(0, str(servers.REPO))
    from deployments.app import AppArgs, policy_kwargs

    engine = engine_kwargs(args)
    engine.setdefault("policy", "apt")
    engine.update(default_ttft_slo_ms=args.ttft_slo_ms, default_tbt_slo_ms=args.tbt_slo_ms)
    app = AppArgs.model_validate({"model": served_checkpoint(args), **engine})
    config = app.engine_config()
    return config.replace(policy_options=policy_kwargs(app, config) or None)


def measure_engine(args, report: dict) -> None:
    """--start engine: the probe against an AsyncLLMEngine in this process (its engine process), no Serve
    app and no HTTP: the engine's own speed, beside the same probe through the server. With --beside, an idle
    server runs beside it the whole time: what its processes alone cost the engine's compute threads."""
    with contextlib.ExitStack() as stack:
        if args.beside is not None:  # an idle Serve app beside the probe, up before the engine starts
            print(f"starting {args.beside} beside the engine", flush=True)
            stack.enter_context(servers.running(beside_spec(args), args.log_dir / f"peer_sweep_{args.label}_beside.log"))
        probe_engine(args, report)


def bare_serve_spec() -> servers.ServerSpec:
    """``benchmarks/bare_serve.py``: Ray Serve and one trivial deployment, on ours's port."""
    cmd = [servers.serve_binary(), "run", "benchmarks.bare_serve:app"]
    return servers.ServerSpec("bare-serve", cmd, servers.server_env(), servers.OURS_PORT)


def beside_spec(args) -> servers.ServerSpec:
    """--beside: ``bare-serve`` (``bare_serve_spec``) or ``app`` (our app on the same checkpoint and engine
    settings, as --start ours starts it), idle."""
    if args.beside == "bare-serve":
        return bare_serve_spec()
    return start_spec(argparse.Namespace(**{**vars(args), "start": "ours"}))


def probe_engine(args, report: dict) -> None:
    from apt_serve_ray import AsyncLLMEngine
    from apt_serve_ray.bench.engine_client import replay_engine

    engine = AsyncLLMEngine(engine_config(args))
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        def run(trace, client):
            return loop.run_until_complete(replay_engine(trace, engine, client, {}))

        header = stamp(threads=args.num_threads, dtype=args.dtype, model=args.shape, simulated=False,
                       started_here="engine", beside=args.beside)
        print(f"\n== {args.label} probe (in-process engine)", flush=True)
        where = "AsyncLLMEngine in the client's process" + (f", beside an idle {args.beside}" if args.beside else "")
        result = entry(header, args, None, args.shape, where,
                       probe("", args.shape, args, run))
    finally:
        engine.shutdown()
        loop.close()
    keep(args, report, result)


def entry(header: dict, args, url, model: str, note: str, probed) -> dict:
    """One label's entry in the report: the run's stamp, what was measured where, its probe."""
    return {**header, "url": url, "model": model, "note": note, "cpu": header["machine"]["cpu"],
            "native_bf16": header["machine"]["native_bf16"], "config": vars(args), "probe": probed, "workloads": {}}


def keep(args, report: dict, result: dict) -> None:
    """``result`` as this label's entry, the report written to --json."""
    report["servers"][args.label] = result
    if args.json:
        write_json(args.json, report, stamp(threads=None, dtype=None, model=None, simulated=False))
        print(f"\nwritten {args.json}")


def measure(args, report: dict, base_url: str) -> None:
    """Probe and / or sweep the server at ``base_url``; its entry in ``report`` (written to --json)."""
    url = base_url + args.endpoint
    try:
        model = args.model or asyncio.run(first_model(base_url))
        asyncio.run(warm_up(url, model))
    except (OSError, aiohttp.ClientError) as e:
        raise SystemExit(f"error: cannot reach {base_url}: {e}")
    previous = report["servers"].get(args.label, {})
    # The client runs on the servers' machine here (base URL 127.0.0.1): its CPU is theirs.
    header = stamp(threads=args.num_threads if args.start else None, dtype=args.dtype if args.start else None,
                   model=model, simulated=False, started_here=args.start)
    result = entry(header, args, base_url, model, f"started here: {args.start}" if args.start else "",
                   previous.get("probe"))
    if args.probe or args.probe_only:
        print(f"\n== {args.label} probe", flush=True)
        result["probe"] = probe(url, model, args)
    if not args.probe_only:
        result["workloads"] = {w: sweep(w, url, model, args) for w in args.workloads}
    result["workloads"] = {**previous.get("workloads", {}), **result["workloads"]}  # workloads run one at a time
    keep(args, report, result)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (``wakeups.py`` starts its servers from the same flags)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--label", required=True, help="this server's name in the JSON and the table")
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "longbench"])
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="req/s (default: per workload)")
    ap.add_argument("--rates-sharegpt", type=float, nargs="+", default=None, help="sharegpt's (over --rates)")
    ap.add_argument("--rates-longbench", type=float, nargs="+", default=None, help="longbench's (over --rates)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=128, help="output cap")
    ap.add_argument("--vocab-size", type=int, default=49152, help="range of random prompt token ids")
    ap.add_argument("--cv", type=float, default=1.0, help="arrival burstiness (1 = Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=4000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=1000.0)
    ap.add_argument("--stop-below", type=float, default=0.3, help="skip higher rates once attainment is below this")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--baseline", default=None, help="label to take ratios against in the table")
    ap.add_argument("--json", type=Path, default=None, help="results file; this label's workloads are added or replaced")
    ap.add_argument("--out-dir", type=Path, default=None, help="attainment plots of every label in the JSON")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--probe", action="store_true", help="also measure single-stream and saturated speed")
    ap.add_argument("--probe-only", action="store_true", help="only the probe, no rate sweep")
    ap.add_argument("--probe-input-len", type=int, default=384)
    ap.add_argument("--probe-output-len", type=int, default=128)
    ap.add_argument("--probe-single", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--probe-saturated", type=int, default=64, help="requests sent at once")
    ap.add_argument("--start", choices=("ours", "vllm", "vllm-nopc", "engine"), default=None,
                    help="start this server here (on its own port), measure, stop it: the engine flags below and "
                         "--shape say what it serves; ours with watermarks at 1.0 (vLLM has no admission control, "
                         "and a 503 would count as a miss) and the SLOs as its defaults (apt schedules by them); "
                         "engine: ours's engine config in this process, no Serve app or HTTP (--probe-only)")
    ap.add_argument("--beside", choices=("bare-serve", "app"), default=None,
                    help="--start engine: keep an idle server running beside the probe: bare-serve (Ray Serve with "
                         "one trivial deployment, benchmarks/bare_serve.py) or app (ours, as --start ours starts it)")
    ap.add_argument("--shape", default="opt-125m", help="--start: the random-weight checkpoint served (its name)")
    ap.add_argument("--checkpoint", default=None,
                    help="--start: serve this local folder instead (e.g. quantized by models/quantize_checkpoint.py), "
                         "named --shape")
    ap.add_argument("--server-args", default="", help="--start: extra server arguments, one string")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="--start: the server's log")
    add_cache_dir(ap)
    add_engine_args(ap, *COMMON, "policy", dtype=Default("bfloat16", "vllm_compare.sh's default"), **{
        **PEER_MATCHED, "max_model_len": Default(1024, "the traces' prompts and outputs fit (outputs <= 128)")})
    args = ap.parse_args(argv)
    for name in ("num_requests", "max_model_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rates and not all(r > 0 and math.isfinite(r) for r in args.rates):
        ap.error("--rates must be finite and > 0")
    unknown = set(args.workloads) - set(DEFAULT_RATES)
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)}; valid: {sorted(DEFAULT_RATES)}")

    if args.beside is not None and args.start != "engine":
        ap.error("--beside: only with --start engine")
    if args.start == "engine" and not args.probe_only:
        ap.error("--start engine: only the probe (--probe-only); the rate sweep's traces go through a server")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = json.loads(args.json.read_text()) if args.json and args.json.exists() else {"servers": {}}
    if args.start == "engine":
        measure_engine(args, report)
    elif args.start is None:
        measure(args, report, args.base_url.rstrip("/"))
    else:
        spec = start_spec(args)
        with servers.running(spec, args.log_dir / f"peer_sweep_{args.label}.log"):
            measure(args, report, spec.base_url)
    print_probe_table(report, args.baseline)
    print_table(report, args.baseline)
    if args.out_dir:
        workload_names = sorted({w for s in report["servers"].values() for w in s["workloads"]})
        for workload in workload_names:
            points = {label: s["workloads"][workload]["attainment"] for label, s in report["servers"].items()
                      if workload in s["workloads"]}
            slo = next(s["workloads"][workload]["slo"] for s in report["servers"].values() if workload in s["workloads"])
            path = plots.plot_attainment(points, args.out_dir / f"peer_attainment_{workload}.png",
                                         title=f"{workload}: TTFT < {slo['ttft_ms']:.0f} ms, "
                                               f"P99 gap < {slo['tbt_ms']:.0f} ms (client side)")
            print(f"plot {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

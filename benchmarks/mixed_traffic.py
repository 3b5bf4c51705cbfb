"""The traffic Apt-Serve is for (issue 26, SPEC section 7): short chats beside long documents, bursty
arrivals, two service levels, memory that binds. Attainment per class, goodput, and why each miss.

    # the engine in-process, policies side by side on one trace (per-step explanation of every miss)
    python benchmarks/mixed_traffic.py engine --policies apt apt-kv sarathi --rates 0.25 0.4 0.6 \\
        --dtype float32 --json docs/benchmarks/mixed/engine_fp32.json

    # through HTTP: our Serve app as serve_config.yaml ships it, and vLLM's CPU build with its defaults
    PEER=/path/to/vllm-peer python benchmarks/mixed_traffic.py serve --servers ours ours-kv vllm vllm-priority \\
        --rates 0.25 0.4 0.6 --dtype float32 --json docs/benchmarks/mixed/serve_fp32.json

The trace is ``bench/mixed_trace.py``'s, every length range and target a flag, re-timed per rate with
token ids of its own at every rate and seed. ``engine``: one engine per policy (``engine_options``),
every step recorded, so a miss is explained by the steps in the gap it broke; ``serve``: one server at
a time (``servers.named``). The settings, the servers and the results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from apt_serve_ray.bench import servers
from apt_serve_ray.bench.engine_args import (PEER_DTYPE, PEER_MATCHED, add_cache_dir, add_engine_args, engine_kwargs,
                                             random_checkpoint)
from apt_serve_ray.bench.http_client import ClientOptions, replay as http_replay
from apt_serve_ray.bench.misses import analyze, prediction_table, report_tables, server_steps
from apt_serve_ray.bench.mixed_trace import TrafficClass, make_mixed_trace
from apt_serve_ray.bench.plots import plot_attainment_panels
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.slo_metrics import effective_at, mean_by_rate
from apt_serve_ray.bench.workloads import ServiceClass, Uniform, WorkloadSpec, fill_token_ids, fresh_ids, with_rate

VOCAB = 49152  # the SmolLM2 tokenizer the random checkpoints carry


# The trace ---------------------------------------------------------------------------------------
def _range(text: str) -> Uniform:
    low, _, high = text.partition(":")
    return Uniform(int(low), int(high or low))


def traffic_classes(args) -> tuple[TrafficClass, TrafficClass]:
    chat = TrafficClass(ServiceClass("chat", args.chat_share, args.chat_ttft_ms, args.chat_tbt_ms, args.chat_priority),
                        WorkloadSpec("chat", _range(args.chat_prompt), _range(args.chat_output)))
    doc = TrafficClass(ServiceClass("document", round(1.0 - args.chat_share, 6), args.doc_ttft_ms, args.doc_tbt_ms,
                                    args.doc_priority),
                       WorkloadSpec("document", _range(args.doc_prompt), _range(args.doc_output)))
    return chat, doc


def base_trace(args, seed: int):
    trace = make_mixed_trace(traffic_classes(args), args.num_requests, 1.0, cv=args.cv, seed=seed,
                             max_model_len=args.max_model_len)
    return fill_token_ids(trace, VOCAB, seed)


# Engine mode -------------------------------------------------------------------------------------
def engine_options(name: str, args) -> dict:
    """EngineConfig fields per policy name (see the module docstring)."""
    common = engine_kwargs(args)
    if name == "apt":
        return dict(common, policy="apt", cache_kinds=("hidden", "kv-int8"), enable_watermarks=True,
                    light_watermark=0.7, heavy_watermark=0.9, max_hidden_ratio=0.7, swap_space=4.0)
    if name == "apt-open":  # apt as it was before issue 44: admits whatever memory allows, no reservation
        return dict(engine_options("apt", args), policy_options={"admission_share": None, "reserve_after": None,
                                                                 "write_off_late": False})
    if name == "apt-keeplate":  # apt without writing off the waiting requests predicted late
        return dict(engine_options("apt", args), policy_options={"write_off_late": False})
    if name == "apt-evictany":  # priority preemption of any victim, even one that cannot be back in time
        return dict(engine_options("apt", args), policy_options={"evict_within_promise": False})
    if name == "apt-inturn":  # those predicted late written off in turn, not the fewest (the longest first)
        return dict(engine_options("apt", args), policy_options={"write_off_fewest": False})
    if name == "apt-prev":  # as before issue 44's fifth pass: in turn, the reservation passed on at admission
        return dict(engine_options("apt", args), policy_options={"write_off_fewest": False, "keep_reservation": False})
    if name == "apt-notier":  # apt without the tier below memory: preempted requests are recomputed
        return dict(engine_options("apt", args), swap_space=0.0)
    if name in ("apt-int4", "apt-int8"):  # apt on weights kept quantized (the memory they save: cache pages)
        return dict(engine_options("apt", args), quantization=name.split("-")[1])
    if name == "apt-kv":
        return dict(common, policy="apt", cache_ratio=0.0, enable_hybrid_cache=False, swap_space=4.0)
    if name in ("sarathi", "fcfs", "priority"):
        return dict(common, policy=name, cache_ratio=0.0, enable_hybrid_cache=False, calibrate_rho=False,
                    swap_space=0.0)
    raise SystemExit(f"--policies: unknown {name!r}; valid: apt apt-int4 apt-int8 apt-open apt-keeplate apt-evictany apt-inturn apt-prev apt-notier apt-kv sarathi fcfs priority")


def run_engine(args) -> dict:
    from apt_serve_ray import LLM
    from apt_serve_ray.bench.driver import replay

    path = "smollm2-135m-instruct" if args.model == "smollm2" else random_checkpoint("opt-125m", args.cache_dir)
    engines = {}
    for name in args.policies:
        options = engine_options(name, args)
        if args.memory_budget_mib:  # one budget for weights and cache: what lighter weights save goes to pages
            options = {k: v for k, v in options.items() if k not in ("num_pages", "cache_budget_bytes")}
            options["memory_budget_bytes"] = int(args.memory_budget_mib * 2**20)
        engines[name] = LLM(path, **options)
        print(f"{name}: {engines[name].llm_engine.cache_stats().num_pages} pages", flush=True)
    results = {name: [] for name in args.policies}
    calib = {}
    for name, llm in engines.items():
        costs = getattr(llm.llm_engine.scheduler.policy, "costs", None)
        if costs is not None and costs.step_time is not None:
            st = costs.step_time
            calib[name] = {"a": st.a, "b": st.b, "c": st.c, "d": getattr(st, "d", 0.0), "r2": st.r2,
                           "points": [list(p) for p in st.points]}
    for seed in args.seeds:
        base = base_trace(args, seed)
        classes = {r.request_id: r.service_class for r in base}
        for k, rate in enumerate(args.rates):
            trace = fresh_ids(with_rate(base, rate, cv=args.cv, seed=seed), VOCAB, seed, rate)
            order = args.policies[k % len(args.policies):] + args.policies[: k % len(args.policies)]
            for name in order:
                res = replay(engines[name], trace, progress=not args.quiet, desc=f"{name} {rate}",
                             run_id=f"{name}-{seed}-{rate}", timeout_s=args.timeout)
                ids = {t.request_id: classes[t.request_id.split("/", 1)[1]] for t in res.timelines}
                a = analyze(res.timelines, ids, res.duration_s, res.steps, res.start_s)
                a.update(rate=rate, seed=seed, num_preemptions=res.num_preemptions, num_steps=len(res.steps),
                         prediction=prediction_table(res.steps), peak_pages=res.peak_pages,
                         preempt_causes=res.preempt_causes)
                if args.keep_steps:
                    a["steps"] = res.steps
                results[name].append(a)
                print(row(name, a), flush=True)
    return {"results": results, "calibration": calib}


# Serve mode --------------------------------------------------------------------------------------
def run_serve(args) -> dict:
    ckpt = random_checkpoint("opt-125m", args.cache_dir)
    results = {}
    for name in args.servers:
        spec = servers.named(name, engine_kwargs(args), model=ckpt, served_model_name="opt-125m",
                             ours_args=args.ours_args, vllm_args=args.vllm_args, vllm_port=args.vllm_port)
        log = Path(args.log_dir) / f"mixed_{name}.log"
        print(f"== {name}: starting ({' '.join(spec.cmd[:3])} ...; log {log})", flush=True)
        results[name] = []
        with servers.running(spec, log):
            client = ClientOptions(timeout=args.timeout, disable_tqdm=args.quiet, request_fields=spec.told)
            url = f"{spec.base_url}/v1/completions"
            # Warm-up prompts of their own seed: none of the trace's prompts may sit in a prefix cache.
            warm = [dataclasses.replace(r, arrival_s=0.0, output_len=4) for r in base_trace(args, 999_983)[:2]]
            asyncio.run(http_replay(warm, url, "opt-125m", client, {}))
            for seed in args.seeds:
                base = base_trace(args, seed)
                classes = {r.request_id: r.service_class for r in base}
                for rate in args.rates:
                    trace = fresh_ids(with_rate(base, rate, cv=args.cv, seed=seed), VOCAB, seed, rate)
                    origin = []
                    timelines, duration = asyncio.run(http_replay(trace, url, "opt-125m", client, {},
                                                                  on_start=origin.append))
                    steps = server_steps(spec.port, origin[0], duration) if name.startswith("ours") else None
                    a = analyze(timelines, classes, duration, steps)
                    a.update(rate=rate, seed=seed)
                    if steps:
                        a["prediction"] = prediction_table(steps)
                        if args.keep_steps:
                            a["steps"] = steps
                    results[name].append(a)
                    print(row(name, a), flush=True)
    return {"results": results}


# Report ------------------------------------------------------------------------------------------
def row(name: str, a: dict) -> str:
    al, ch, dc = a["all"], a.get("chat", {}), a.get("document", {})
    return (f"{name:14s} seed {a['seed']} rate {a['rate']:5.2f}  attainment {al['attainment']:6.1%} / "
            f"{ch.get('attainment', 0):6.1%} / {dc.get('attainment', 0):6.1%}  goodput {al['goodput']:.3f}  "
            f"TTFT misses {ch.get('ttft_misses', 0)}/{ch.get('num', 0)} {dc.get('ttft_misses', 0)}/{dc.get('num', 0)}  "
            f"gap misses {ch.get('gap_misses', 0)} {dc.get('gap_misses', 0)}  longest gap "
            f"{ch.get('median_longest_gap_ms', 0) / 1000:.2f} / {dc.get('median_longest_gap_ms', 0) / 1000:.2f} s")


GROUPS = ("all", "chat", "document")


def effective(results: dict) -> dict:
    """Effective throughput at 90% and 60% per name and class (attainment averaged over seeds)."""
    return {name: {g: effective_at(mean_by_rate(runs, lambda a: a[g]["attainment"])) for g in GROUPS}
            for name, runs in results.items()}


def plot(results: dict, out_dir: Path, tag: str) -> list[str]:
    panels = {f"{g}: SLO attainment": {name: mean_by_rate(runs, lambda a: a[g]["attainment"])
                                        for name, runs in results.items()} for g in GROUPS}
    return [str(plot_attainment_panels(panels, out_dir / f"attainment{tag}.png"))]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("engine", "serve", "report"),
                   help="report: print the tables of --json (with --baseline, goodput ratios against it)")
    p.add_argument("--baseline", default="vllm", help="report: the server goodput ratios are against")
    p.add_argument("--policies", nargs="+", default=["apt", "apt-kv", "sarathi"], help="engine mode")
    p.add_argument("--model", default="opt-125m", choices=("opt-125m", "smollm2"),
                   help="engine mode: random OPT-125m, or the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--memory-budget-mib", type=float, default=None,
                   help="engine mode: memory_budget_bytes (weights and cache) for every engine instead of --num-pages")
    p.add_argument("--servers", nargs="+", default=["ours", "vllm"], help="serve mode")
    p.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.4, 0.6])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--cv", type=float, default=3.0)
    p.add_argument("--chat-share", type=float, default=0.7)
    p.add_argument("--chat-prompt", default="64:256", help="LOW:HIGH tokens, uniform")
    p.add_argument("--chat-output", default="32:128")
    p.add_argument("--chat-ttft-ms", type=float, default=2000)
    p.add_argument("--chat-tbt-ms", type=float, default=500)
    p.add_argument("--chat-priority", type=int, default=0)
    p.add_argument("--doc-prompt", default="900:1500")
    p.add_argument("--doc-output", default="64:128")
    p.add_argument("--doc-ttft-ms", type=float, default=12000)
    p.add_argument("--doc-tbt-ms", type=float, default=1000)
    p.add_argument("--doc-priority", type=int, default=10)
    add_engine_args(p, dtype=PEER_DTYPE, **PEER_MATCHED)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds after the last arrival (engine) / per request")
    p.add_argument("--vllm-port", type=int, default=8100, help="ours listens on 8000 (serve run's port)")
    p.add_argument("--ours-args", nargs="*", default=[], help="extra key=value arguments for `serve run`")
    p.add_argument("--vllm-args", nargs="*", default=[], help="extra vLLM server flags")
    add_cache_dir(p)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", type=Path, default=None, help="merged into if it exists (one key per name)")
    p.add_argument("--out-dir", type=Path, default=None, help="plots")
    p.add_argument("--tag", default="")
    p.add_argument("--keep-steps", action="store_true", help="every step record in the JSON (engine mode)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.chat_share < 1:
        p.error("--chat-share: must be in (0, 1)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "report":
        if args.json is None or not args.json.exists():
            raise SystemExit("report: --json must name a results file")
        print(report_tables(json.loads(args.json.read_text())["runs"], args.baseline))
        if args.out_dir:
            runs = json.loads(args.json.read_text())["runs"]
            args.out_dir.mkdir(parents=True, exist_ok=True)
            print("plots:", *plot({k.split(":", 1)[1]: v["results"] for k, v in runs.items()}, args.out_dir, args.tag))
        return
    # The code that runs: stamped at the start (a commit made while it runs is not its code).
    header = stamp(threads=args.num_threads, dtype=args.dtype,
                   model="SmolLM2-135M-Instruct" if args.model == "smollm2" else "opt-125m (random weights)",
                   simulated=False, mode=args.mode)
    out = run_engine(args) if args.mode == "engine" else run_serve(args)
    eff = effective(out["results"])
    print("\neffective throughput (req/s) at 90% / 60% attainment: all | chat | documents")
    for name, e in eff.items():
        print(f"  {name:14s} " + " | ".join(f"{e[g]['90']:.3f} / {e[g]['60']:.3f}" for g in ("all", "chat", "document")))
    if args.json:
        doc = json.loads(args.json.read_text()) if args.json.exists() else {}
        doc.setdefault("runs", {})
        for name, runs in out["results"].items():
            doc["runs"][f"{args.mode}:{name}"] = {
                **header, "results": runs, "effective_throughput": eff[name], "started": header["date"],
                "config": vars(args), "calibration": out.get("calibration", {}).get(name),
            }
        write_json(args.json, doc, header)
        print(f"written: {args.json}")
    if args.out_dir:  # every server or policy in the JSON (earlier runs too), else this run's
        results = ({k.split(":", 1)[1]: v["results"] for k, v in doc["runs"].items() if k.startswith(args.mode + ":")}
                   if args.json else out["results"])
        args.out_dir.mkdir(parents=True, exist_ok=True)
        print("plots:", *plot(results, args.out_dir, args.tag))


if __name__ == "__main__":
    main()

"""Traffic that repeats itself (issue 27): multi-turn conversations sharing system prompts, documents
asked several questions. Ours with and without prefix caching against vLLM's CPU build with and
without it, one server at a time, the same sessions at each rate.

    PEER=/path/to/vllm-peer python benchmarks/prefix_reuse.py serve \\
        --servers ours vllm ours-nopc vllm-nopc --rates 0.15 0.3 0.6 --dtype float32 \\
        --json docs/benchmarks/prefix/serve_fp32.json
    python benchmarks/prefix_reuse.py report --json docs/benchmarks/prefix/serve_fp32.json

The sessions are ``bench/conversations.py``'s (every range and target a flag); ``sim`` compares cache
rules on ``SimulatedEngine`` in seconds. Measured at the client: attainment per class, goodput, TTFT
p50/p90, the hit rate each server reports, effective throughput. The setup and results:
docs/benchmarks.md ("Traffic that repeats itself").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench import servers
from apt_serve_ray.bench.conversations import ConversationSpec, make_sessions, shared_token_share
from apt_serve_ray.bench.engine_args import (PEER_DTYPE, PEER_MATCHED, add_cache_dir, add_engine_args, engine_kwargs,
                                             random_checkpoint)
from apt_serve_ray.bench.http_client import ClientOptions, run_sessions
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.slo_metrics import effective_throughput, p99_gap_ms, passes_slo, ttft_ms
from apt_serve_ray.bench.workloads import Uniform, fresh_ids


def analyze(records, duration_s: float) -> dict:
    def group(rows) -> dict:
        timelines = [t for _, _, t, _ in rows]
        ok = [passes_slo(t) for t in timelines]
        ttfts = [ttft_ms(t) for t in timelines if ttft_ms(t) is not None]
        prompt = sum(t.num_prompt_tokens for t in timelines)
        cached = [c for _, _, _, c in rows if c is not None]
        return {
            "num": len(rows), "met": int(sum(ok)), "attainment": float(np.mean(ok)) if ok else 0.0,
            "goodput": sum(ok) / duration_s, "errors": sum(t.error is not None for t in timelines),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p90_ms": float(np.percentile(ttfts, 90)) if ttfts else None,
            "ttft_misses": sum(1 for t in timelines if t.error is None and (ttft_ms(t) or 1e18) >= t.ttft_slo_ms),
            "gap_misses": sum(1 for t in timelines if t.is_finished and p99_gap_ms(t) >= t.tbt_slo_ms),
            "prompt_tokens": prompt,
            "cached_tokens": int(sum(cached)) if cached else None,
            "hit_rate": (sum(cached) / prompt) if cached and prompt else None,
        }

    out = {"duration_s": duration_s, "all": group(records)}
    for name in ("chat", "document"):
        rows = [r for r in records if r[0].service.name == name]
        if rows:
            out[name] = group(rows)
    later = [r for r in records if r[1] > 0]
    if later:
        out["later_turns"] = group(later)
    out["requests"] = [{"session": s.session_id, "turn": turn, "class": s.service.name,
                        "prompt": t.num_prompt_tokens, "cached": c, "ttft_ms": ttft_ms(t),
                        "p99_gap_ms": p99_gap_ms(t) if t.is_finished else None, "met": passes_slo(t),
                        "error": t.error} for s, turn, t, c in records]
    return out


# Servers -----------------------------------------------------------------------------------------
def spec_of(args) -> ConversationSpec:
    return ConversationSpec(num_sessions=args.sessions, chat_share=args.chat_share, num_groups=args.groups,
                            system_len=Uniform(*args.system_len), turns=Uniform(*args.turns), think_s=args.think_s,
                            num_documents=args.documents, max_model_len=args.max_model_len)


def run_serve(args, save=None) -> dict:
    """Every server in turn; ``save(data)`` after each run, so that what was measured survives a
    server that fails to start later."""
    ckpt = random_checkpoint("opt-125m", args.cache_dir)
    spec = spec_of(args)
    results, failed = {}, {}
    for name in args.servers:
        # vLLM reports cached tokens with --enable-prompt-tokens-details (it changes nothing else).
        server = servers.named(name, engine_kwargs(args), model=ckpt, served_model_name="opt-125m",
                               ours_args=args.ours_args, vllm_args=["--enable-prompt-tokens-details", *args.vllm_args],
                               vllm_port=args.vllm_port)
        log = Path(args.log_dir) / f"prefix_{name}.log"
        print(f"== {name}: starting ({' '.join(server.cmd[:3])} ...; log {log})", flush=True)
        try:
            proc = servers.start_server(server, log)
        except (RuntimeError, OSError, SystemExit) as exc:
            print(f"== {name}: did not start ({exc}); the other servers go on", flush=True)
            failed[name] = str(exc)
            continue
        results[name] = []
        url, client = f"{server.base_url}/v1/completions", ClientOptions(timeout=args.timeout, request_fields=server.told)
        try:
            warm = make_sessions(ConversationSpec(num_sessions=2, turns=Uniform(1, 1)), 100.0, seed=999_983)
            asyncio.run(run_sessions(warm, url, "opt-125m", client))  # its own seed: nothing of the trace cached
            for seed in args.seeds:
                for rate in args.rates:
                    sessions = make_sessions(spec, rate, args.cv, seed)
                    if not args.same_tokens:  # no help from what the server cached at the rate before
                        sessions = fresh_ids(sessions, spec.vocab_size, seed, rate)
                    records, duration = asyncio.run(run_sessions(sessions, url, "opt-125m", client))
                    a = analyze(records, duration)
                    a.update(rate=rate, seed=seed, ideal_hit_rate=shared_token_share(sessions))
                    results[name].append(a)
                    print(row(name, a), flush=True)
                    if save is not None:
                        save({"results": results, "failed": failed})
                    if len(args.rates) > 1 or len(args.seeds) > 1:
                        time.sleep(args.idle_s)  # idle between rates: every conversation of the last has ended
        finally:
            servers.stop_server(proc)
    return {"results": results, "failed": failed}


# Simulated (a lab study: the real scheduler, pool and prefix cache on a cost model's clock) ----------
def run_sim(args) -> dict:
    """Every ``--variants`` entry (``name`` or ``name:key=value,...``, EngineConfig fields over the
    shipped scheduling: apt, hidden + kv-int8 under engine watermarks, a tier) on the same sessions,
    replayed on ``SimulatedEngine`` (its replies are one token id repeated: the history re-sent is
    still the conversation's own). No model, no HTTP, no controller: for comparing cache rules side by
    side in seconds, not for comparing with vLLM."""
    from apt_serve_ray.bench.conversations import replay_simulated
    from apt_serve_ray.bench.simulator import CostModel, SimulatedEngine
    from apt_serve_ray.config import EngineConfig
    from apt_serve_ray.scheduler.costs import StepCosts

    spec = dataclasses.replace(spec_of(args), vocab_size=32_000)
    cost = CostModel(base_s=args.sim_cost[0], per_token_s=args.sim_cost[1], per_context_s=args.sim_cost[2],
                     prefill_pair_s=args.sim_cost[3], hidden_context_s=args.sim_cost[4])
    results = {}
    for variant in args.variants:
        name, _, options = variant.partition(":")
        overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in options.split(",") if kv)}
        config = EngineConfig(**{**dict(policy="apt", cache_kinds=["hidden", "kv-int8"], cache_ratio=0.0,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_num_seqs=args.max_num_seqs, swap_space=4.0, enable_watermarks=True,
                                        max_hidden_ratio=0.7), **overrides})
        results[name] = []
        for seed in args.seeds:
            for rate in args.rates:
                sessions = make_sessions(spec, rate, args.cv, seed)
                sim = SimulatedEngine(config, num_pages=args.num_pages, cost=cost, max_model_len=args.max_model_len)
                if hasattr(sim.scheduler.policy, "set_costs"):  # as the engine calibrates them: rho, step times
                    sim.scheduler.policy.set_costs(StepCosts(rho=args.sim_rho, step_time=cost))
                records = replay_simulated(sim, sessions)
                a = analyze(records, sim.now)
                a.update(rate=rate, seed=seed, ideal_hit_rate=shared_token_share(sessions))
                results[name].append(a)
                print(row(name, a), flush=True)
    return {"results": results, "cost_model": dataclasses.asdict(cost)}


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# Report ------------------------------------------------------------------------------------------
def _fmt(x, pattern="{:.0f}"):
    return "-" if x is None else pattern.format(x)


def row(name: str, a: dict) -> str:
    al, ch, dc = a["all"], a.get("chat", {}), a.get("document", {})
    return (f"{name:10s} seed {a['seed']} rate {a['rate']:5.2f}  attainment {al['attainment']:6.1%} / "
            f"{ch.get('attainment', 0):6.1%} / {dc.get('attainment', 0):6.1%}  goodput {al['goodput']:.3f}  "
            f"TTFT p50/p90 chat {_fmt(ch.get('ttft_p50_ms'))}/{_fmt(ch.get('ttft_p90_ms'))} ms "
            f"doc {_fmt(dc.get('ttft_p50_ms'))}/{_fmt(dc.get('ttft_p90_ms'))} ms  "
            f"hit {_fmt(al.get('hit_rate'), '{:.1%}')} (ideal {a['ideal_hit_rate']:.1%})  "
            f"misses TTFT {al['ttft_misses']} gap {al['gap_misses']} errors {al['errors']}")


def effective(results: dict) -> dict:
    out = {}
    for name, runs in results.items():
        for seed in sorted({a["seed"] for a in runs}):
            pts = [(a["rate"], a["all"]["attainment"]) for a in runs if a["seed"] == seed]
            out.setdefault(name, {})[seed] = {f"{int(t * 100)}%": effective_throughput(pts, t) for t in (0.9, 0.6)}
    return out


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [f"# {path.name}: {data.get('machine', {}).get('cpu', '?')}, dtype {data.get('args', {}).get('dtype')}"]
    for name, runs in data["results"].items():
        for a in runs:
            lines.append(row(name, a))
    lines.append("effective throughput (sessions/s at 90% / 60% attainment): " + json.dumps(effective(data["results"])))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("serve", "sim", "report"))
    p.add_argument("--servers", nargs="+", default=["ours", "vllm", "ours-nopc", "vllm-nopc"])
    p.add_argument("--rates", nargs="+", type=float, default=[0.15, 0.3, 0.6], help="sessions a second")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--sessions", type=int, default=30)
    p.add_argument("--chat-share", type=float, default=0.75)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--documents", type=int, default=3)
    p.add_argument("--system-len", nargs=2, type=int, default=[200, 1000])
    p.add_argument("--turns", nargs=2, type=int, default=[3, 8])
    p.add_argument("--think-s", type=float, default=5.0)
    p.add_argument("--cv", type=float, default=1.0)
    add_engine_args(p, dtype=PEER_DTYPE, **PEER_MATCHED)
    p.add_argument("--ours-args", nargs="*", default=[])
    p.add_argument("--vllm-args", nargs="*", default=[])
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--same-tokens", action="store_true",
                   help="serve: every rate sends the same token ids (one seed, one set of sessions re-timed), so "
                        "a rate finds what the rate before it left in the server's cache; by default each rate's "
                        "sessions are relabelled into tokens of their own (bench.workloads.fresh_ids)")
    add_cache_dir(p)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variants", nargs="+", default=["value", "lru:prefix_cache_retention=lru"],
                   help="sim: name[:EngineConfig field=value,...] each")
    # The step-time model the engine calibrated at start-up for random OPT-125m in fp32 on one thread
    # of the Intel Xeon (AMX) of 2026-12-04 (``StepCosts.step_time``; hidden: per token of hidden context).
    p.add_argument("--sim-cost", nargs=5, type=float, default=[0.031, 0.00104, 9.4e-6, 5.5e-7, 2.1e-6],
                   metavar=("BASE_S", "PER_TOKEN_S", "PER_CONTEXT_S", "PREFILL_PAIR_S", "HIDDEN_CONTEXT_S"),
                   help="sim: the step-time cost model")
    p.add_argument("--sim-rho", type=float, default=3.4e-5, help="sim: seconds a step per hidden page (calibrated as above)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "report":
        if args.json is None:
            raise SystemExit("report: --json PATH")
        print(report(args.json))
        return
    header = stamp(threads=args.num_threads, dtype=args.dtype, model="opt-125m (random weights)",
                   simulated=args.mode == "sim")

    def save(data: dict) -> None:
        if args.json is not None:
            write_json(args.json, {**data, "args": vars(args)}, header)

    data = run_sim(args) if args.mode == "sim" else run_serve(args, save)
    print("effective throughput (sessions/s at 90% / 60%):", json.dumps(effective(data["results"])))
    save(data)
    if args.json is not None:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""SLO attainment and effective throughput, policy against policy, on one model, page budget and trace.

    python benchmarks/serving_policies.py --quick [--json docs/benchmarks/serving_policies_quick.json]

One in-process engine per policy (random-weight OPT-125m shape), the same ShareGPT- / LongBench-like
traces re-timed for every rate, policies interleaved per rate; ``--simulate`` runs the same on
``SimulatedEngine``'s clock with the stored cost model (or one measured now, ``--calibrate``). Outputs:
a table, ``--json`` (``effective_throughput[workload][policy]["90"|"60"]``, per-run summaries, the
calibrations) and plots in ``--out-dir``. What runs, the defaults' reasons and the results:
docs/benchmarks.md ("Policies on the real engine", "Policies on a simulated clock").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

from apt_serve_ray import LLM
from apt_serve_ray.bench import plots
from apt_serve_ray.bench.driver import measure_unloaded_latency, replay, replay_simulated
from apt_serve_ray.bench.engine_args import PEER_MATCHED, Default, add_cache_dir, add_engine_args, engine_kwargs, \
    random_checkpoint
from apt_serve_ray.bench.policy_variants import cache_options, policy_of
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.servers import REPO
from apt_serve_ray.bench.simulator import CPU_OPT125M, CPU_OPT125M_RHO, calibrated_cost, simulated_engine
from apt_serve_ray.bench.slo_metrics import effective_at, format_ratio, mean_by_rate
from apt_serve_ray.bench.workloads import make_trace, with_rate
from apt_serve_ray.config import EngineConfig
DEFAULT_POLICIES = ("fcfs", "sarathi", "priority", "apt", "apt-kv")


# Per-mode defaults (per workload where a dict).
MODES = {
    "quick": dict(num_requests={"sharegpt": 12, "longbench": 10}, max_model_len=512, num_pages=189,
                  max_output_len={"sharegpt": 64, "longbench": 32},
                  rates={"sharegpt": (2.0, 4.0, 8.0), "longbench": (0.6, 1.2, 2.4)}),
    "full": dict(num_requests={"sharegpt": 48, "longbench": 48}, max_model_len=1024, num_pages=378,
                 max_output_len={"sharegpt": 128, "longbench": 128},
                 rates={"sharegpt": (0.5, 1.0, 1.5, 2.0, 3.0), "longbench": (0.15, 0.3, 0.45, 0.6, 0.9)}),
}


# Engines -----------------------------------------------------------------------------------------
def build_engine(name: str, path: str, args) -> LLM:
    is_apt = name.startswith("apt")
    return LLM(path, **engine_kwargs(args, policy=policy_of(name), calibrate_rho=is_apt, enable_watermarks=False,
                                     **cache_options(name)))


class EngineRunner:
    """Real runs: one engine for the policy, replayed in real time."""

    def __init__(self, name: str, path: str, args) -> None:
        self.llm = build_engine(name, path, args)

    def warm_up(self, base) -> None:  # first-call allocations, off the clock
        measure_unloaded_latency(self.llm, base, num_requests=1, output_len=4)

    def run(self, trace, slo: dict, args, desc: str, run_id: str):
        return replay(self.llm, trace, ttft_slo_ms=slo["ttft_ms"], tbt_slo_ms=slo["tbt_ms"],
                      progress=not args.no_progress, timeout_s=args.timeout_s, desc=desc, run_id=run_id)

    def calibration(self) -> dict | None:
        policy = self.llm.llm_engine.scheduler.policy
        if not hasattr(policy, "rho"):
            return None
        m = getattr(policy, "step_model", None)
        costs = policy.costs
        return {"rho_s_per_page": policy.rho, "hidden_allowed": self.llm.llm_engine.hidden_allowed,
                "kind_s_per_page": {k.value: s for k, s in costs.kind_costs},
                "unavailable": [k.value for k in costs.unavailable],
                "offered": [k.value for k in self.llm.llm_engine.compressed_kinds],
                "step_model": None if m is None else {"a": m.a, "b": m.b, "c": m.c, "r2": m.r2,
                                                      "hidden_s_per_token": m.hidden_seconds_per_token}}


class SimulatedRunner:
    """``--simulate``: the same policy, page pool and trace on a simulated clock (``cost``, ``rho``)."""

    def __init__(self, name: str, args, cost, rho: float) -> None:
        self.name, self.args, self.cost, self.rho = name, args, cost, rho

    def warm_up(self, base) -> None:
        pass

    def run(self, trace, slo: dict, args, desc: str, run_id: str):
        name = self.name
        config = EngineConfig(policy=policy_of(name), calibrate_rho=False, enable_watermarks=False,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                              **cache_options(name))
        sim = simulated_engine(config, cost=self.cost, rho=self.rho, num_pages=args.num_pages,
                               max_model_len=args.max_model_len)
        return replay_simulated(sim, trace, ttft_slo_ms=slo["ttft_ms"], tbt_slo_ms=slo["tbt_ms"])

    def calibration(self) -> dict | None:
        if self.name.startswith("apt"):
            return {"rho_s_per_page": self.rho, "cost_model": dataclasses.asdict(self.cost),
                    "calibrated_on": self.args.calibrate or "stored (bench/simulator.py CPU_OPT125M)"}


# One workload ------------------------------------------------------------------------------------
def _per_workload(value, workload: str):
    return value[workload] if isinstance(value, dict) else value


def run_workload(workload: str, runners: dict, args) -> dict:
    base = make_trace(workload, _per_workload(args.num_requests, workload), 1.0, cv=args.cv, seed=args.seed,
                      max_model_len=args.max_model_len,  # token ids: replay fills them, seeded
                      max_output_len=_per_workload(args.max_output_len, workload))
    for runner in runners.values():
        runner.warm_up(base)
    slo = {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "scale": None}
    if args.slo_scale is not None:
        if args.simulate:
            raise SystemExit("--slo-scale needs real runs (it measures the engine); give --ttft-slo-ms/--tbt-slo-ms")
        unloaded = measure_unloaded_latency(runners.get("sarathi", next(iter(runners.values()))).llm, base)
        slo = {"ttft_ms": args.slo_scale * unloaded["ttft_ms"], "tbt_ms": args.slo_scale * unloaded["tpot_ms"],
               "scale": args.slo_scale, "unloaded": unloaded}
    rates = sorted(getattr(args, f"rates_{workload}", None) or args.rates or MODES[args.mode]["rates"][workload])
    policies = list(runners)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    results = {}
    print(f"\n== {workload}: {len(base)} requests, prompt mean {statistics.mean(r.prompt_len for r in base):.0f}, "
          f"output mean {statistics.mean(r.output_len for r in base):.0f} tokens; SLO TTFT {slo['ttft_ms']:.0f} ms, "
          f"P99 gap {slo['tbt_ms']:.0f} ms", flush=True)
    k = 0
    for rate in rates:
        trace = with_rate(base, rate, cv=args.cv, seed=args.seed)
        for repeat in range(args.repeats):
            k += 1
            for name in policies[k % len(policies):] + policies[: k % len(policies)]:
                t = time.perf_counter()
                result = runners[name].run(trace, slo, args, f"{workload} {rate:g}/s {name}",
                                           f"{workload}-{rate:g}-{repeat}-{name}")
                s = result.summary()
                runs[name].append({"rate": rate, "repeat": repeat, "wall_s": time.perf_counter() - t, "summary": s})
                results.setdefault((name, rate), result)
                _print_run(rate, name, s, time.perf_counter() - t)
    eff, attainment = {}, {}
    for name in policies:
        attainment[name] = mean_by_rate(runs[name], lambda r: r["summary"]["slo_attainment"])
        eff[name] = effective_at(attainment[name])
    _plots(workload, attainment, results, rates, slo, args)
    return {"slo": slo, "rates": rates, "effective_throughput": eff, "attainment": attainment, "runs": runs,
            "trace": {"num_requests": len(base), "prompt_lens": [r.prompt_len for r in base],
                      "output_lens": [r.output_len for r in base]}}


def _print_run(rate: float, name: str, s: dict, wall_s: float) -> None:
    print(f"  {rate:5.2f} req/s {name:9s} attain {100 * s['slo_attainment']:5.1f}%  "
          f"miss ttft/tbt {s['ttft_misses']:2d}/{s['tbt_misses']:2d}  preempt {s['num_preemptions']:3d} "
          f"{s['preempt_causes'] or ''}  peak kv/hid/int8 {s['peak_pages']['kv']:3d}/{s['peak_pages']['hidden']:3d}/"
          f"{s['peak_pages'].get('kv-int8', 0) + s['peak_pages'].get('hidden-int8', 0):3d}  "
          f"ttft mean {s['mean_ttft_ms']:6.0f} p99 itl {s['p99_itl_ms']:5.0f} ms  "
          f"unfinished {s['num_unfinished']}  {wall_s:4.0f}s", flush=True)


def _plots(workload, attainment, results, rates, slo, args) -> None:
    tag = f"{workload}{'_quick' if args.mode == 'quick' else ''}{'_sim' if args.simulate else ''}"
    title = f"{workload}: TTFT < {slo['ttft_ms']:.0f} ms, P99 gap < {slo['tbt_ms']:.0f} ms"
    plots.plot_attainment(attainment, args.out_dir / f"attainment_{tag}.png", title=title)
    top = rates[-1]  # the highest rate: where the policies differ most
    plots.plot_latency_cdfs({p: results[(p, top)].timelines for p in attainment}, args.out_dir / f"cdf_{tag}.png",
                            title=f"{workload} at {top:g} req/s", ttft_slo_ms=slo["ttft_ms"], tbt_slo_ms=slo["tbt_ms"])
    # The memory timeline of the adaptive policy with the most kinds on offer (else the first policy).
    apt = next((q for p in ("apt-all", "apt", "apt-kv") for q in attainment if q.partition("@")[0] == p),
               next(iter(attainment)))
    run = results[(apt, top)]
    run.plot_memory_timeline(args.out_dir / f"memory_{tag}_{apt}.png", title=f"{workload} at {top:g} req/s, {apt}")


# Report ------------------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    print("\nEffective throughput (req/s): highest rate with SLO attainment >= 90% / >= 60%")
    for workload, w in report["workloads"].items():
        eff = w["effective_throughput"]
        print(f"\n{workload} (SLO TTFT {w['slo']['ttft_ms']:.0f} ms, P99 gap {w['slo']['tbt_ms']:.0f} ms; "
              f"rates {w['rates']})")
        print(f"  {'policy':10s} {'@90%':>7s} {'@60%':>7s}   attainment % per rate")
        for p, e in eff.items():
            att = " ".join(f"{100 * a:5.1f}" for _, a in w["attainment"][p])
            print(f"  {p:10s} {e['90']:7.3f} {e['60']:7.3f}   {att}")
        for apt in (p for p in eff if p.startswith("apt")):
            for base in (b for b in ("fcfs", "sarathi") if b in eff):
                print(f"  {apt + ' / ' + base:20s} " + "  ".join(
                    f"@{t}%: {format_ratio(eff[apt][t], eff[base][t])}" for t in ("90", "60")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10-12 requests x 3 rates, max_model_len 512, short outputs")
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "longbench"])
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                    help=f"any of {' '.join(DEFAULT_POLICIES)} (default all)")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="req/s (default: per workload and mode)")
    for w in MODES["full"]["rates"]:
        ap.add_argument(f"--rates-{w}", type=float, nargs="+", default=None, help=f"{w}'s (over --rates)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-output-len", type=int, default=None)
    per_mode = "per mode (MODES): 378 pages and 1024 tokens, --quick 189 and 512: memory binds at either size"
    add_engine_args(ap, **{**PEER_MATCHED, "num_pages": Default(None, per_mode), "max_model_len": Default(None, per_mode)})
    ap.add_argument("--cv", type=float, default=1.0, help="arrival burstiness (1 = Poisson)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (rate, policy); attainment is their mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=4000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=1000.0)
    ap.add_argument("--slo-scale", type=float, default=None, help="SLO = scale x unloaded TTFT / TPOT (overrides ms)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per run, after the last arrival")
    add_cache_dir(ap)
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--simulate", action="store_true",
                    help="simulated clock with the calibrated CPU cost model instead of the engine (seconds, exact)")
    ap.add_argument("--calibrate", default=None, metavar="CHECKPOINT",
                    help="--simulate: measure the cost model on this checkpoint now (default: the stored one)")
    args = ap.parse_args(argv)
    args.mode = "quick" if args.quick else "full"
    for key in ("num_requests", "max_model_len", "max_output_len", "num_pages"):
        if getattr(args, key) is None:
            setattr(args, key, MODES[args.mode][key])
    unknown = {p for p in args.policies if p.partition("@")[0] not in (*DEFAULT_POLICIES, "apt-all", "sarathi-int8")}
    if unknown:
        ap.error(f"--policies: unknown {sorted(unknown)}; valid: {list(DEFAULT_POLICIES)}, apt-all[@RATIO], "
                 "sarathi-int8[@RATIO]")
    if args.slo_scale is not None and not args.slo_scale > 0:
        ap.error("--slo-scale: must be > 0")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    start = time.perf_counter()
    if args.simulate:
        cost, rho = calibrated_cost(args.calibrate, args.dtype) if args.calibrate else \
            (CPU_OPT125M, CPU_OPT125M_RHO)  # bench/simulator.py: calibrated here, 1 thread, bf16
        runners = {name: SimulatedRunner(name, args, cost, rho) for name in args.policies}
    else:
        path = random_checkpoint("opt-125m", args.cache_dir)
        runners = {name: EngineRunner(name, path, args) for name in args.policies}
    calibration = {name: c for name, r in runners.items() if (c := r.calibration()) is not None}
    print(f"{'simulated' if args.simulate else 'engines'} ready in {time.perf_counter() - start:.0f}s: "
          f"{list(runners)}; rho (ms/page) "
          + ", ".join(f"{n} {1000 * c['rho_s_per_page']:.2f}" for n, c in calibration.items()), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = stamp(threads=args.num_threads, dtype=args.dtype, model="opt-125m (random weights)",
                   simulated=args.simulate)
    report = {
        "command": " ".join(["benchmarks/serving_policies.py"] + (argv if argv is not None else sys.argv[1:])),
        "config": vars(args), "cpu": header["machine"]["cpu"], "native_bf16": header["machine"]["native_bf16"],
        "calibration": calibration, "workloads": {},
    }
    for workload in args.workloads:
        report["workloads"][workload] = run_workload(workload, runners, args)
    report["effective_throughput"] = {w: r["effective_throughput"] for w, r in report["workloads"].items()}
    report["wall_s"] = time.perf_counter() - start
    print_table(report)
    print(f"\ntotal {report['wall_s']:.0f}s; plots in {args.out_dir}")
    if args.json:
        write_json(args.json, report, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Policies side by side on a simulated clock: the real scheduler, page pool and policies, with step
times from a cost model instead of a model. Minutes instead of hours, so it sweeps many rates; it
is a study tool beside ``serving_policies.py`` (real runs), not a replacement for it.

    python benchmarks/policy_simulation.py [--workloads sharegpt longbench] [--json out.json]

Default cost model: the one calibrated on this project's 2-core CPU machines for the OPT-125m shape
in bfloat16 (``apt_serve_ray.worker.calibration``): 19.5 ms per step + 1.13 ms per computed token + 15 us
per context token of every scheduled request + 139 us per context token of hidden requests (the
K/V recompute), measured before the engine's C++ attention kernels. ``--calibrate PATH`` measures
one for a checkpoint with today's engine instead (what the engine's own ``apt`` measures at start:
``calibration.measure_costs``), and records it in the JSON.

    python benchmarks/policy_simulation.py --calibrate ~/.cache/apt-serve-ray/opt-125m-bf16 \
        --rates-sharegpt 1 2 3 4 6 8 --rates-longbench 0.3 0.6 0.9 1.2 1.8 2.4 --json out.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from apt_serve_ray.bench.engine_args import PEER_MATCHED, Default, add_engine_args
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.simulator import CPU_OPT125M, CPU_OPT125M_RHO, CostModel, calibrated_cost, simulated_engine
from apt_serve_ray.bench.slo_metrics import effective_at
from apt_serve_ray.bench.workloads import make_trace
from apt_serve_ray.config import EngineConfig

POLICIES = ("fcfs", "sarathi", "priority", "apt", "apt-kv-only")


def simulate(policy: str, trace, args, cost: CostModel, rho: float) -> dict:
    config = EngineConfig(policy="apt" if policy.startswith("apt") else policy, calibrate_rho=False,
                          enable_watermarks=False, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, default_ttft_slo_ms=args.ttft_slo_ms,
                          default_tbt_slo_ms=args.tbt_slo_ms, enable_hybrid_cache=policy != "apt-kv-only",
                          cache_ratio=args.cache_ratio)
    sim = simulated_engine(config, cost=cost, rho=rho, num_pages=args.num_pages)
    pending, requests = list(trace), []
    while pending or sim.scheduler.num_unfinished:
        while pending and pending[0].arrival_s <= sim.now:
            t = pending.pop(0)
            r = sim.add(t.prompt_len, t.output_len)
            r.arrival_time = t.arrival_s
            requests.append(r)
        if not sim.scheduler.num_unfinished:
            sim.now = pending[0].arrival_s
            continue
        sim.step()
    passed = 0
    for r in requests:
        gaps = np.diff(r.token_times)
        p99 = float(np.percentile(gaps, 99)) if len(gaps) else 0.0
        passed += (r.first_token_time - r.arrival_time) * 1e3 < r.ttft_slo_ms and p99 * 1e3 < r.tbt_slo_ms
    return {"attainment": passed / len(requests), "preemptions": sim.scheduler.num_preemptions,
            "unfinished": sum(not r.is_finished for r in requests)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "longbench"])
    p.add_argument("--rates", type=float, nargs="+", default=None, help="requests/s (default per workload)")
    p.add_argument("--rates-sharegpt", type=float, nargs="+", default=None)
    p.add_argument("--rates-longbench", type=float, nargs="+", default=None)
    p.add_argument("--calibrate", default=None, help="checkpoint to measure the cost model on (default: the stored one)")
    p.add_argument("--dtype", default="bfloat16", help="of the calibration run")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    add_engine_args(p, "num_pages", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "cache_ratio",
                    **{**PEER_MATCHED, "num_pages": Default(375, "6,000 KV tokens: the runs of docs/benchmarks.md "
                                                                 "(issue 12); the peer comparisons since use 378"),
                       "cache_ratio": Default(1.0, "no ceiling binds (0: KV only)")})
    p.add_argument("--ttft-slo-ms", type=float, default=4000)
    p.add_argument("--tbt-slo-ms", type=float, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    default_rates = {"sharegpt": [0.1, 0.2, 0.3, 0.4, 0.5, 0.8], "longbench": [0.05, 0.1, 0.15, 0.2, 0.3],
                     "humaneval": [0.2, 0.4, 0.6, 0.8, 1.2]}
    cost, rho = calibrated_cost(args.calibrate, args.dtype) if args.calibrate else (CPU_OPT125M, CPU_OPT125M_RHO)
    print(f"cost model: {cost} ; rho {rho * 1e3:.3f} ms per page per step"
          f" ({'measured on ' + args.calibrate if args.calibrate else 'stored'})")
    results: dict = {"cost_model": vars(cost), "rho": rho, "calibrated_on": args.calibrate, "dtype": args.dtype,
                     "runs": {}, "effective_throughput": {}}
    for workload in args.workloads:
        rates = (getattr(args, f"rates_{workload}", None) or args.rates
                 or default_rates.get(workload, [0.1, 0.2, 0.4, 0.8]))
        print(f"\n{workload}: attainment (preemptions) by rate; SLO TTFT {args.ttft_slo_ms:.0f} ms, "
              f"P99 gap {args.tbt_slo_ms:.0f} ms, {args.num_pages} pages")
        print(f"{'rate':>6} " + " ".join(f"{pol:>16}" for pol in args.policies))
        points: dict[str, list] = {pol: [] for pol in args.policies}
        for rate in rates:
            trace = make_trace(workload, args.num_requests, rate, seed=args.seed, max_model_len=args.max_model_len)
            cells = []
            for pol in args.policies:
                res = simulate(pol, trace, args, cost, rho)
                results["runs"].setdefault(workload, {}).setdefault(pol, {})[str(rate)] = res
                points[pol].append((rate, res["attainment"]))
                cells.append(f"{res['attainment']:>9.2f} ({res['preemptions']:>4})")
            print(f"{rate:>6} " + " ".join(cells), flush=True)
        eff = {pol: effective_at(pts) for pol, pts in points.items()}
        results["effective_throughput"][workload] = eff
        print("effective throughput (req/s) at 90% / 60%: " + ", ".join(
            f"{pol} {e['90']:.3f} / {e['60']:.3f}" for pol, e in eff.items()))
    if args.json:
        header = stamp(threads=1, dtype=args.dtype, model=args.calibrate or "stored OPT-125m cost model",
                       simulated=True)
        write_json(args.json, results, header, indent=2)


if __name__ == "__main__":
    main()

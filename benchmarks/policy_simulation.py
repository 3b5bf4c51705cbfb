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
import json
from pathlib import Path

import numpy as np

from apt_serve_ray.bench.simulator import MHA_LAYOUT, CostModel, SimulatedEngine
from apt_serve_ray.bench.slo_metrics import effective_throughput
from apt_serve_ray.bench.workloads import make_trace
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

CPU_OPT125M = CostModel(base_s=0.0195, per_token_s=0.00113, per_context_s=0.000015, hidden_context_s=0.000139)
RHO_CPU_OPT125M = 0.00222  # seconds per 16-token page per step (hidden_cache_cost.py)
POLICIES = ("fcfs", "sarathi", "priority", "apt", "apt-kv-only")


def simulate(policy: str, trace, args, cost: CostModel, rho: float) -> dict:
    config = EngineConfig(policy="apt" if policy.startswith("apt") else policy, calibrate_rho=False,
                          enable_watermarks=False, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, default_ttft_slo_ms=args.ttft_slo_ms,
                          default_tbt_slo_ms=args.tbt_slo_ms, enable_hybrid_cache=policy != "apt-kv-only",
                          cache_ratio=args.cache_ratio)
    scheduler = None
    if policy.startswith("apt"):
        scheduler = AdaptiveScheduler(config=config, rho=rho, step_model=cost)
    sim = SimulatedEngine(config, layout=MHA_LAYOUT, num_pages=args.num_pages, cost=cost, policy=scheduler)
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


def calibrated(path: str, dtype: str) -> tuple[CostModel, float]:
    """The step-time model and rho the engine measures at start for ``apt`` on this checkpoint."""
    from apt_serve_ray import LLM

    llm = LLM(path, policy="apt", calibrate_rho=True, dtype=dtype, num_threads=1)
    costs = llm.llm_engine.scheduler.policy.costs
    st = costs.step_time
    return CostModel(base_s=st.a, per_token_s=st.b, per_context_s=st.c,
                     hidden_context_s=st.hidden_seconds_per_token), float(costs.rho or 0.0)


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
    p.add_argument("--num-pages", type=int, default=375, help="16-token KV pages (375 = 6,000 tokens, as the vLLM peer)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=4000)
    p.add_argument("--tbt-slo-ms", type=float, default=500)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-ratio", type=float, default=1.0,
                   help="ceiling of the pool's pages in the hidden kind (1: no ceiling binds; 0: KV only)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    default_rates = {"sharegpt": [0.1, 0.2, 0.3, 0.4, 0.5, 0.8], "longbench": [0.05, 0.1, 0.15, 0.2, 0.3],
                     "humaneval": [0.2, 0.4, 0.6, 0.8, 1.2]}
    cost, rho = calibrated(args.calibrate, args.dtype) if args.calibrate else (CPU_OPT125M, RHO_CPU_OPT125M)
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
        eff = {pol: {"90": effective_throughput(pts, 0.9), "60": effective_throughput(pts, 0.6)}
               for pol, pts in points.items()}
        results["effective_throughput"][workload] = eff
        print("effective throughput (req/s) at 90% / 60%: " + ", ".join(
            f"{pol} {e['90']:.3f} / {e['60']:.3f}" for pol, e in eff.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The paper's table on a simulated GPU: effective throughput of ``apt`` against ``fcfs`` (vLLM 0.5) and
``sarathi``, OPT-13B on one A100-80GB (or any device and model of ``bench/gpu_specs.json``).

    python benchmarks/gpu_policies.py [--device a100-80gb] [--model opt-13b] \
        [--json docs/benchmarks/fleet/gpu_policies_a100.json]

Each engine is the real ``LLMEngine`` (scheduler, policy, page pool) on ``bench/gpu_cost.py``'s roofline
of the device: the KV pages its memory holds after the weights (90% of it, vLLM's default), and for
``apt`` the costs the engine would measure there (its calibration run on the simulated runner). ShareGPT-,
LongBench- and HumanEval-like traces (``bench/workloads.py``), Poisson arrivals (``--cv``), token ids
fresh for every rate and seed. SLOs as the paper sets them, a scale of the unloaded latency: TTFT
``--ttft-scale`` x one prefill of the trace's mean prompt, P99 gap ``--tbt-scale`` x one decode step of
one request, on the same device. Effective throughput: the highest rate with attainment >= 90% (60%),
attainment the mean over ``--seeds`` at each rate. Outputs: a table, ``--json``, a plot per workload.
Variants (``bench/policy_variants.py``): ``apt`` here is KV only; ``apt-hidden`` the paper's hybrid cache.
Token budgets: ``fcfs`` and ``apt`` 2,048 (the model length, vLLM 0.5's), ``sarathi`` 512 (``--sarathi-budget``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from apt_serve_ray.bench import gpu_cost, plots
from apt_serve_ray.bench.driver import replay_simulated
from apt_serve_ray.bench.policy_variants import cache_options, policy_of
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.slo_metrics import effective_at, format_ratio, mean_by_rate
from apt_serve_ray.bench.workloads import fresh_token_ids, make_trace, with_rate
from apt_serve_ray.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]
# Rates (req/s) that cross 90% attainment for every policy on OPT-13B / A100-80GB at the default SLOs.
RATES = {"sharegpt": (0.25, 0.5, 1, 2, 3, 4, 6), "longbench": (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0),
         "humaneval": (1, 2, 4, 8, 12, 16, 24)}
# The paper's ratios of effective throughput at 90% (Apt-Serve over vLLM, over Sarathi-Serve): 2.3x and
# 1.9x on average over its datasets and models (SPEC section 3); per dataset they are in its figures.
PAPER = {"fcfs": 2.3, "sarathi": 1.9}


def engine(name: str, cost, args, costs):
    budget = args.sarathi_budget if policy_of(name) == "sarathi" else args.max_num_batched_tokens
    config = EngineConfig(policy=policy_of(name), calibrate_rho=False, enable_watermarks=False,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, **cache_options(name))
    return gpu_cost.gpu_engine(config, cost, max_model_len=args.max_model_len, costs=costs.get(config.cache_kinds))


def run_workload(workload: str, cost, args, costs: dict) -> dict:
    base = make_trace(workload, args.num_requests, 1.0, cv=args.cv, seed=0, max_model_len=args.max_model_len)
    mean_prompt = statistics.mean(r.prompt_len for r in base)
    ttft0, tpot0 = cost.prefill_s(round(mean_prompt)), cost.decode_s(1, round(mean_prompt))
    slo = {"ttft_ms": 1000 * args.ttft_scale * ttft0, "tbt_ms": 1000 * args.tbt_scale * tpot0,
           "ttft_scale": args.ttft_scale, "tbt_scale": args.tbt_scale,
           "unloaded_ttft_ms": 1000 * ttft0, "unloaded_tpot_ms": 1000 * tpot0}
    rates = getattr(args, f"rates_{workload}") or RATES[workload]
    print(f"\n== {workload}: {len(base)} requests, prompt mean {mean_prompt:.0f}, output mean "
          f"{statistics.mean(r.output_len for r in base):.0f}; SLO TTFT {slo['ttft_ms']:.0f} ms, P99 gap "
          f"{slo['tbt_ms']:.0f} ms", flush=True)
    runs = {p: [] for p in args.policies}
    for rate in rates:
        for seed in range(args.seeds):
            trace = fresh_token_ids(with_rate(base, rate, cv=args.cv, seed=seed), cost.shape.vocab_size, seed, rate)
            for name in args.policies:
                t = time.perf_counter()
                s = replay_simulated(engine(name, cost, args, costs), trace, ttft_slo_ms=slo["ttft_ms"],
                                     tbt_slo_ms=slo["tbt_ms"]).summary()
                runs[name].append({"rate": rate, "seed": seed, "wall_s": time.perf_counter() - t,
                                   "summary": {k: s[k] for k in _KEEP if k in s}})
                print(f"  {rate:6.2f} req/s seed {seed} {name:11s} attain {100 * s['slo_attainment']:5.1f}%  "
                      f"miss ttft/tbt {s['ttft_misses']:3d}/{s['tbt_misses']:3d}  preempt {s['num_preemptions']:4d}  "
                      f"peak kv/hid {s['peak_pages']['kv']:5d}/{s['peak_pages']['hidden']:5d}  "
                      f"{time.perf_counter() - t:5.1f}s", flush=True)
    attainment = {p: mean_by_rate(runs[p], lambda r: r["summary"]["slo_attainment"]) for p in args.policies}
    eff = {p: effective_at(a) for p, a in attainment.items()}
    title = f"{workload}, {cost.shape.name} on {cost.dev.name} (simulated): TTFT < {slo['ttft_ms']:.0f} ms, " \
            f"P99 gap < {slo['tbt_ms']:.0f} ms"
    tag = f"{workload}_{cost.shape.name}_{cost.dev.name}_tbt{args.tbt_scale:g}"  # runs of other settings keep theirs
    plots.plot_attainment(attainment, args.out_dir / f"gpu_attainment_{tag}.png", title=title)
    return {"slo": slo, "rates": list(rates), "attainment": attainment, "effective_throughput": eff, "runs": runs}


_KEEP = ("slo_attainment", "ttft_misses", "tbt_misses", "num_preemptions", "peak_pages", "mean_ttft_ms",
         "p99_itl_ms", "output_throughput", "mean_schedule_ms", "mean_step_ms", "num_unfinished", "final_kinds")


def print_table(report: dict) -> None:
    print(f"\nEffective throughput (req/s) at 90% / 60% attainment, {report['device']} {report['model']} (simulated)")
    for workload, w in report["workloads"].items():
        eff = w["effective_throughput"]
        print(f"\n{workload}: TTFT {w['slo']['ttft_ms']:.0f} ms, P99 gap {w['slo']['tbt_ms']:.0f} ms")
        for p, e in eff.items():
            print(f"  {p:12s} {e['90']:7.2f} {e['60']:7.2f}   " + " ".join(f"{100 * a:5.1f}" for _, a in w["attainment"][p]))
        for apt in (p for p in eff if p.startswith("apt")):
            for b in (b for b in PAPER if b in eff):
                print(f"  {apt} / {b}: @90% {format_ratio(eff[apt]['90'], eff[b]['90'])} (paper {PAPER[b]}x on "
                      f"average), @60% {format_ratio(eff[apt]['60'], eff[b]['60'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="a100-80gb", choices=gpu_cost.devices())
    ap.add_argument("--model", default="opt-13b", choices=gpu_cost.models())
    ap.add_argument("--workloads", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--policies", nargs="+", default=["fcfs", "sarathi", "apt", "apt-hidden"])
    for w in RATES:
        ap.add_argument(f"--rates-{w}", type=float, nargs="+", default=None, help=f"req/s (default {RATES[w]})")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--cv", type=float, default=1.0)
    ap.add_argument("--ttft-scale", type=float, default=5.0)
    ap.add_argument("--tbt-scale", type=float, default=5.0)
    ap.add_argument("--max-model-len", type=int, default=2048, help="OPT's context")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM 0.5's: the model length")
    ap.add_argument("--sarathi-budget", type=int, default=512,
                    help="sarathi's token budget: vLLM's chunked-prefill default (a whole 2,048-token chunk "
                         "would stall every decode for 0.3 s on the A100)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks" / "fleet")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    for name in args.policies:
        cache_options(name)  # ValueError naming an unknown variant
    cost = gpu_cost.GpuCostModel(gpu_cost.device(args.device), gpu_cost.model_shape(args.model))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # The costs apt measures at start, once per set of kinds offered (every engine of a variant alike).
    costs = {}
    for name in args.policies:
        config = EngineConfig(policy=policy_of(name), calibrate_rho=False, **cache_options(name))
        if config.policy == "apt" and config.cache_kinds not in costs:
            probe = gpu_cost.gpu_engine(config.replace(policy="fcfs"), cost, max_model_len=args.max_model_len)
            costs[config.cache_kinds] = gpu_cost.step_costs(probe.runner, cost, kinds=config.cache_kinds)
    report = {"device": args.device, "model": args.model, "cost_model": gpu_cost.summary(cost),
              "num_pages": gpu_cost.kv_pages(cost.dev, cost.shape), "paper_ratios_at_90": PAPER,
              "workloads": {w: run_workload(w, cost, args, costs) for w in args.workloads}}
    print_table(report)
    if args.json:
        header = stamp(threads=1, dtype="bfloat16", model=f"{args.model} (cost model)", simulated=True,
                       device=args.device)
        print("wrote", write_json(args.json, report, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())

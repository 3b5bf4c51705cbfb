"""Service classes under overload: attainment and longest wait per class, policy against policy (issue 16).

    python benchmarks/priority_classes.py [--json docs/benchmarks/priority/priority_classes.json]

ShareGPT- and LongBench-like traces, each request given a service class (``--classes``; default 30%
interactive, 70% batch); a class-blind ``fcfs`` pass finds the sustainable rate, then every policy runs
at ``--multiples`` of it, on the simulator (deterministic; ``--calibrate`` measures its cost model now)
or with ``--real CHECKPOINT`` on the engine in real time. Per class: attainment, longest TTFT and
longest pending time; the issue's aim is checked at 1.5x. Setup and results: docs/benchmarks.md
("Priorities and service classes").
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench.driver import replay, replay_simulated
from apt_serve_ray.bench.engine_args import PEER_MATCHED, add_engine_args, engine_kwargs
from apt_serve_ray.bench.plots import plot_attainment, plot_longest_waits
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.simulator import (CPU_OPT125M_KERNELS, CPU_OPT125M_KERNELS_RHO, CostModel, calibrated_cost,
                                          simulated_engine)
from apt_serve_ray.bench.slo_metrics import (attainment, effective_throughput, inter_token_gaps_ms, p99_gap_ms,
                                           ttft_ms)
from apt_serve_ray.bench.workloads import ServiceClass, assign_classes, make_trace, with_rate
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

STORED_COST, STORED_RHO = CPU_OPT125M_KERNELS, CPU_OPT125M_KERNELS_RHO  # bench/simulator.py
DEFAULT_CLASSES = ("interactive:0.3:1000:100:0", "batch:0.7:30000:1000:10")
POLICIES = ("apt", "apt-1100", "priority", "sarathi", "fcfs")
WEIGHT_KEYS = {"time": "time_weight", "memory": "memory_weight", "slo": "slo_weight", "priority": "priority_weight",
               "fairness": "fairness_penalty", "max_wait": "max_wait_time",
               "priority_preemption": "priority_preemption"}
PROBE_RATES = {"sharegpt": (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0), "longbench": (0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.2)}


def parse_classes(specs: list[str]) -> list[ServiceClass]:
    if any(spec.count(":") != 4 for spec in specs):
        raise SystemExit(f"--classes: want NAME:SHARE:TTFT_MS:TBT_MS:PRIORITY each, got {specs}")
    return [ServiceClass(n, float(share), float(ttft), float(tbt), int(prio))
            for n, share, ttft, tbt, prio in (spec.split(":") for spec in specs)]


def parse_weights(pairs: list[str] | None) -> dict:
    """``time=1 memory=0.8 slo=1.2 priority=2 [fairness=0.1 max_wait=60]`` -> AdaptiveScheduler kwargs."""
    options = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        if key not in WEIGHT_KEYS or not value:
            raise SystemExit(f"weights: want KEY=VALUE with KEY in {sorted(WEIGHT_KEYS)}, got {pair!r}")
        options[WEIGHT_KEYS[key]] = float(value)
    return options


def policy_options(name: str, args) -> dict | None:
    """None for the baselines; AdaptiveScheduler's keyword arguments for the two apt variants."""
    if name == "apt":
        return parse_weights(args.apt_weights)
    if name == "apt-1100":
        return parse_weights(args.compare_weights)
    return None


# Runs --------------------------------------------------------------------------------------------
def run_simulated(name: str, trace, args, cost: CostModel, rho: float):
    options = policy_options(name, args)
    config = EngineConfig(policy="apt" if options is not None else name, policy_options=options,
                          calibrate_rho=False, enable_watermarks=False, cache_ratio=0.0, swap_space=args.swap_space,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    sim = simulated_engine(config, cost=cost, rho=rho, num_pages=args.num_pages, max_model_len=args.max_model_len,
                           apt_options=options)
    return replay_simulated(sim, trace), sim.scheduler.policy


class RealRunner:
    """``--real``: one engine per policy, loaded once, every rate replayed in real time."""

    def __init__(self, path: str, args) -> None:
        from apt_serve_ray import LLM

        self.engines = {}
        for name in args.policies:
            options = policy_options(name, args)
            self.engines[name] = LLM(path, **engine_kwargs(
                args, policy="apt" if options is not None else name, policy_options=options,
                calibrate_rho=options is not None, dtype="bfloat16", cache_ratio=0.0, enable_watermarks=False))

    def __call__(self, name: str, trace, args):
        llm = self.engines[name]
        result = replay(llm, trace, progress=False, timeout_s=args.timeout_s, run_id=f"{name}-{time.monotonic_ns()}")
        return result, llm.llm_engine.scheduler.policy


# Figures per class -------------------------------------------------------------------------------
def longest_pending_s(t) -> float:
    """Arrival to first token, or between two tokens, whichever is longest (to now if unfinished)."""
    ttft = ttft_ms(t)
    waits = [ttft if ttft is not None else math.inf, *inter_token_gaps_ms(t)]
    return max(waits) / 1000.0


def class_figures(result, trace, classes, max_wait_s: float | None) -> dict:
    by_id = {tr.request_id: tr.service_class for tr in trace}
    figures = {}
    for c in classes:
        tls = [t for t in result.timelines if by_id[t.request_id.rsplit("/", 1)[-1]] == c.name]
        ttfts = [v / 1000.0 for v in map(ttft_ms, tls) if v is not None]
        pending = [longest_pending_s(t) for t in tls]
        late = [t for t in tls if ttft_ms(t) is None or ttft_ms(t) >= c.ttft_slo_ms]
        figures[c.name] = {
            "num_requests": len(tls), "attainment": attainment(tls),
            "num_passed": int(round(attainment(tls) * len(tls))),
            "finished": sum(t.is_finished for t in tls) / max(1, len(tls)),
            # Why the misses missed: first token late (or never), or a P99 gap over the TBT target.
            "num_ttft_misses": len(late),
            "num_tbt_misses": sum(t.is_finished and p99_gap_ms(t) >= c.tbt_slo_ms for t in tls),
            "max_ttft_s": max(ttfts) if ttfts and len(ttfts) == len(tls) else None,  # None: one never started
            "mean_ttft_s": float(np.mean(ttfts)) if ttfts else None,
            "max_pending_s": max(pending, default=0.0),
            "num_over_max_wait": None if max_wait_s is None else sum(p > max_wait_s for p in pending),
        }
    return figures


def run_point(run, name: str, trace, classes, args) -> dict:
    result, policy = run(name, trace, args)
    max_wait = getattr(policy, "max_wait_time", None) or args.reference_max_wait
    s = result.summary()
    return {"attainment": s["slo_attainment"], "preemptions": result.num_preemptions,
            "unfinished": result.num_unfinished, "duration_s": result.duration_s, "max_wait_time_s": max_wait,
            "weights": None if not hasattr(policy, "weights") else vars(policy.weights),
            "classes": class_figures(result, trace, classes, max_wait)}


# The sweep ---------------------------------------------------------------------------------------
def sustainable_rate(workload: str, base, classes, run, args) -> tuple[float, list]:
    """fcfs, every request on the most lenient class's SLOs: the rate the server holds at 90% attainment."""
    lenient = max(classes, key=lambda c: (c.ttft_slo_ms, c.tbt_slo_ms))
    blind = assign_classes(base, [ServiceClass(lenient.name, 1.0, lenient.ttft_slo_ms, lenient.tbt_slo_ms, 0)])
    points, rates = [], list(args.probe_rates or PROBE_RATES[workload])
    while rates:
        rate = rates.pop(0)
        result, _ = run("fcfs", with_rate(blind, rate, seed=args.seed), args)
        points.append((rate, result.summary()["slo_attainment"]))
        if not rates and points[-1][1] >= 0.9 and len(points) < 20:  # the limit lies higher (a short trace)
            rates.append(2 * rate)
    return effective_throughput(points, 0.9), points


def run_workload(workload: str, classes, run, args) -> dict:
    trace = make_trace(workload, args.num_requests, 1.0, seed=args.seed, max_model_len=args.max_model_len,
                       max_output_len=args.max_output_len)
    base = assign_classes(trace, classes, seed=args.seed)
    rates = getattr(args, f"rates_{workload}")
    report: dict = {"runs": {}}
    given = dict(pair.split("=") for pair in args.sustainable or [])
    if rates is None and workload in given:
        cap = report["sustainable_rate"] = float(given[workload])
        rates = [round(m * cap, 4) for m in args.multiples]
        print(f"\n{workload}: sustainable rate {cap:.3f} req/s (given); rates {rates}")
    elif rates is None:
        cap, probe = sustainable_rate(workload, base, classes, run, args)
        report.update(sustainable_rate=cap, probe=probe)
        rates = [round(m * cap, 4) for m in args.multiples]
        print(f"\n{workload}: sustainable rate {cap:.3f} req/s (fcfs, class-blind, 90% within the lenient SLOs;"
              f" probe {probe}); rates {rates}")
    report["rates"] = rates
    names = [c.name for c in classes]
    print(f"{workload}: attainment per class ({' / '.join(names)}), longest pending s ({' / '.join(names)}),"
          f" requests pending past max_wait_time")
    for rate in rates:
        trace = with_rate(base, rate, seed=args.seed)
        for name in args.policies:
            point = run_point(run, name, trace, classes, args)
            report["runs"].setdefault(name, {})[str(rate)] = point
            cf = point["classes"]
            over = sum(f["num_over_max_wait"] or 0 for f in cf.values())
            print(f"{rate:>7.3f} {name:>9}: " + " / ".join(f"{cf[n]['attainment']:.2f}" for n in names)
                  + "   " + " / ".join(f"{cf[n]['max_pending_s']:6.1f}" for n in names)
                  + f"   over {over:>3}   preempt {point['preemptions']:>4}", flush=True)
    return report


def check_aim(report: dict, classes, args) -> dict | None:
    """The issue's aim at the rate closest to 1.5x sustainable (None if no rate was derived from it)."""
    cap = report.get("sustainable_rate")
    if not cap or "apt" not in report["runs"] or "priority" not in report["runs"]:
        return None
    rate = min(report["rates"], key=lambda r: abs(r - 1.5 * cap))
    first, last = classes[0].name, classes[-1].name  # most and least important, as given
    apt, prio = report["runs"]["apt"][str(rate)]["classes"], report["runs"]["priority"][str(rate)]["classes"]
    checks = {
        f"{first} >= 90% under apt": apt[first]["attainment"] >= 0.9,
        f"{last} absorbs the misses under apt": apt[last]["attainment"] <= apt[first]["attainment"],
        "no request pending past max_wait_time (apt)": all(f["num_over_max_wait"] == 0 for f in apt.values()),
        f"apt >= priority on {first}": apt[first]["attainment"] >= prio[first]["attainment"],
        f"apt passes more {last} than priority": (apt[last]["num_passed"] > prio[last]["num_passed"]
                                                   or apt[last]["attainment"] == 1.0),
    }
    return {"rate": rate, "multiple": rate / cap, "checks": checks, "met": all(checks.values())}


def markdown_table(report: dict, rate: float, classes) -> str:
    """Per policy at one rate: per class passed/total, longest TTFT and pending, pending past the bound."""
    head = "| policy | " + " | ".join(f"{c.name}: passed, longest TTFT / pending (s)" for c in classes) + \
        " | pending > max_wait_time |"
    lines = [head, "|---" * (len(classes) + 2) + "|"]
    for name, runs in report["runs"].items():
        cf = runs[str(rate)]["classes"]

        def cell(f) -> str:
            ttft = "never" if f["max_ttft_s"] is None else f"{f['max_ttft_s']:.1f}"
            return f"{f['num_passed']}/{f['num_requests']} ({f['attainment']:.0%}), {ttft} / {f['max_pending_s']:.1f}"

        over = sum(f["num_over_max_wait"] or 0 for f in cf.values())
        lines.append(f"| {name} | " + " | ".join(cell(cf[c.name]) for c in classes) + f" | {over} |")
    return "\n".join(lines)


def plots(workload: str, report: dict, classes, out_dir: Path, tag: str) -> list[str]:
    paths = []
    for c in classes:
        points = {name: [(float(r), p["classes"][c.name]["attainment"]) for r, p in runs.items()]
                  for name, runs in report["runs"].items()}
        path = out_dir / f"attainment_{workload}_{c.name}{tag}.png"
        plot_attainment(points, path, title=f"{workload}-like, class {c.name} (TTFT {c.ttft_slo_ms / 1e3:g} s, "
                                            f"P99 gap {c.tbt_slo_ms:g} ms, priority {c.priority})")
        paths.append(str(path))
    paths.append(str(plot_longest_waits(report["runs"], classes, out_dir / f"longest_wait_{workload}{tag}.png",
                                        title=f"{workload}-like: longest wait for a first token or between two tokens")))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "longbench"], choices=sorted(PROBE_RATES))
    p.add_argument("--classes", nargs="+", default=list(DEFAULT_CLASSES), help="NAME:SHARE:TTFT_MS:TBT_MS:PRIORITY")
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--apt-weights", nargs="*", default=None, help="e.g. time=1 memory=0.8 slo=1.2 priority=2 "
                                                                   "(default: the tree's AdaptiveScheduler defaults)")
    p.add_argument("--compare-weights", nargs="*", default=["time=1", "memory=1", "slo=0", "priority=0"],
                   help="apt-1100's weights")
    p.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    p.add_argument("--probe-rates", type=float, nargs="+", default=None)
    p.add_argument("--sustainable", nargs="+", default=None, metavar="WORKLOAD=RATE",
                   help="skip the capacity pass (e.g. for --real: sharegpt=1.06)")
    p.add_argument("--rates-sharegpt", type=float, nargs="+", default=None)
    p.add_argument("--rates-longbench", type=float, nargs="+", default=None)
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--max-output-len", type=int, default=None)
    add_engine_args(p, "num_pages", "swap_space", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                    "num_threads", **PEER_MATCHED)
    p.add_argument("--reference-max-wait", type=float, default=AdaptiveScheduler().max_wait_time,
                   help="the bound checked for policies without max_wait_time (apt's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", default=None, help="checkpoint to measure the cost model on (default: stored)")
    p.add_argument("--real", default=None, metavar="CHECKPOINT", help="run on the real engine instead")
    p.add_argument("--timeout-s", type=float, default=300.0, help="--real: after the last arrival")
    p.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks/priority"))
    p.add_argument("--tag", default="", help="suffix of the plot names")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    classes = parse_classes(args.classes)
    started = time.monotonic()

    if args.real:
        run = RealRunner(args.real, args)
        mode = f"real engine ({args.real}, bf16, {args.num_threads} thread(s), real time)"
        cost_info = None
    else:
        cost, rho = calibrated_cost(args.calibrate) if args.calibrate else (STORED_COST, STORED_RHO)
        run = lambda name, trace, a: run_simulated(name, trace, a, cost, rho)  # noqa: E731
        mode = "simulator (SimulatedEngine: real scheduler and policies, cost-model step times, simulated clock)"
        cost_info = {"cost_model": vars(cost), "rho": rho, "calibrated_on": args.calibrate or "stored"}
        print(f"cost model ({cost_info['calibrated_on']}): {cost}; rho {rho * 1e3:.4f} ms per page per step")
    print(f"mode: {mode}; " + ("real time, noisy" if args.real else "deterministic for a given cost model"))
    print("classes: " + ", ".join(f"{c.name} {c.share:.0%} TTFT {c.ttft_slo_ms:g} ms P99 gap {c.tbt_slo_ms:g} ms "
                                  f"priority {c.priority}" for c in classes))
    for name in ("apt", "apt-1100"):
        policy = AdaptiveScheduler(**policy_options(name, args))
        print(f"{name}: {vars(policy.weights)}, fairness_penalty {policy.fairness_penalty:g}, "
              f"max_wait_time {policy.max_wait_time:g} s" + (" (the tree's defaults)" if name == "apt"
                                                             and not args.apt_weights else ""))

    header = stamp(threads=args.num_threads if args.real else None, dtype="bfloat16" if args.real else None,
                   model=args.real or "simulated OPT-125m layout", simulated=not args.real)
    results: dict = {"mode": mode, "classes": [vars(c) for c in classes], "cost": cost_info,
                     "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads:
        report = run_workload(workload, classes, run, args)
        report["aim"] = check_aim(report, classes, args)
        report["plots"] = plots(workload, report, classes, args.out_dir, args.tag)
        results["workloads"][workload] = report
        aim = report["aim"]
        if aim:
            print(f"{workload}: aim at {aim['rate']:.3f} req/s ({aim['multiple']:.2f}x sustainable): "
                  f"{'MET' if aim['met'] else 'NOT met'}: "
                  + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in aim["checks"].items()))
            print(markdown_table(report, aim["rate"], classes))
    results["wall_s"] = time.monotonic() - started
    print(f"wall time {results['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, results, header, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

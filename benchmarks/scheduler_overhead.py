"""Time the adaptive scheduler against the number of candidate requests: the value model and greedy
alone, and the whole decision an engine iteration pays.

    python benchmarks/scheduler_overhead.py --sizes 100 400 1600 6400 --json docs/benchmarks/scheduler_overhead.json

``score_greedy_ms``: value model + greedy on ready numpy arrays of n candidates (what the paper's
figure times); ``full_decision_ms``: all of ``Scheduler.schedule()`` under ``apt`` in the simulator's
engine kept saturated at n candidates (median and p90 over ``--full-steps``), ``first_sight_ms`` its
first decision; ``--all-run``: the same with no batch limit. The JSON's ``what`` says each column;
results: docs/benchmarks.md ("Scheduler decision time").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench.engine_args import Default, add_engine_args
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.simulator import SimulatedEngine
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.knapsack import greedy_select
from apt_serve_ray.scheduler.value import ValueWeights, urgency

SIZES = (50, 100, 200, 400, 800, 1600, 3200, 6400, 12800)
PAPER_MS = {"50": 0.3, "1600": 10.8}
WEIGHTS = ValueWeights(time_weight=1.0, slo_weight=1.0, priority_weight=0.5)


# Score + greedy ----------------------------------------------------------------------------------
def _instance(rng: np.random.Generator, n: int, rho_s_per_page: float) -> dict:
    mem_kv = rng.integers(1, 129, n)
    arrival = -rng.uniform(0.0, 10.0, n)
    return dict(
        pending_s=-arrival,  # now = 0
        deadline=arrival + rng.choice([2.0, 4.0, 8.0], n),
        importance=rng.integers(0, 3, n).astype(np.float64),
        mem_kv=mem_kv,
        mem_hidden=(mem_kv + 1) // 2,
        hidden_ok=np.ones(n, dtype=bool),
        # U*rho*m with U = the requests that can still meet their SLO (about half here).
        recompute_cost=(n // 2) * rho_s_per_page * mem_kv,
        capacity=int(0.4 * mem_kv.sum()),
    )


def _score_and_select(inst: dict) -> None:
    value = WEIGHTS.value(inst["pending_s"], urgency(0.0, inst["deadline"], 2.0), inst["importance"])
    greedy_select(value, inst["recompute_cost"], inst["mem_kv"], inst["mem_hidden"], inst["hidden_ok"],
                  inst["capacity"], memory_weight=WEIGHTS.memory_weight)


def measure_greedy(n: int, repeats: int, rng: np.random.Generator, rho: float) -> tuple[float, float]:
    """Median and p90 ms of value model + greedy over ``repeats`` fresh instances."""
    for _ in range(3):  # warm caches and numpy's dispatch
        _score_and_select(_instance(rng, n, rho))
    times = []
    for _ in range(repeats):
        inst = _instance(rng, n, rho)
        start = time.perf_counter()
        _score_and_select(inst)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times)), float(np.percentile(times, 90))


# The whole decision ------------------------------------------------------------------------------
class Scenario:
    """A saturated engine (the simulator's: real scheduler, page pool and policy, no model) kept at
    ``n`` candidates: ``num_running`` decoding, the rest waiting (prompts 16..512 tokens, TTFT SLO
    2/4/8 s, the first ones arrived over the last 5 s); memory fits the running ones and about half
    of the waiting ones. Every step, arrivals top the candidates up to ``n`` again."""

    def __init__(self, n: int, rng: np.random.Generator, rho: float, max_num_seqs: int, max_tokens: int,
                 cache_ratio: float = 1.0, cache_kinds: tuple[str, ...] = ("hidden",),
                 policy_options: dict | None = None) -> None:
        self.n, self.rng = n, rng
        num_running = min(n // 2, max_num_seqs)
        prompts = rng.integers(16, 513, n)
        running, waiting = prompts[:num_running], prompts[num_running:]
        num_pages = int((running // 16 + 3).sum() + (waiting // 16 + 1).sum() // 2) + 1
        config = EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_tokens, cache_ratio=cache_ratio, cache_kinds=cache_kinds,
                              policy_options=policy_options or {})
        self.sim = sim = SimulatedEngine(config, num_pages=num_pages)
        # As on the engine, which always measures both: rho and a step-time model (the simulator's own).
        sim.scheduler.policy.set_costs(StepCosts(rho=rho, step_time=sim.cost,
                                                 kind_costs={k: rho / 20 for k in ("kv-int8", "hidden-int8")}))
        started = [sim.add(int(p), 1024) for p in running]
        for _ in range(1000):  # prefill them (chunked under the token budget) until every one decodes
            if all(r.is_decoding for r in started):
                break
            sim.step()
        else:
            raise RuntimeError("scenario: the running requests did not all reach decoding")
        for p in waiting:
            self.arrive(int(p), rng.uniform(0.0, 5.0))

    def arrive(self, prompt_len: int, waited_s: float = 0.0) -> None:
        r = self.sim.add(prompt_len, 64, ttft_slo_ms=float(self.rng.choice([2000.0, 4000.0, 8000.0])))
        r.arrival_time = self.sim.now - waited_s

    def step(self):
        """Top the candidates up to ``n``, then one engine step; its ``SchedulerOutput``."""
        sched = self.sim.scheduler
        for _ in range(self.n - len(sched.running) - len(sched.waiting)):
            self.arrive(int(self.rng.integers(16, 513)))
        return self.sim.step()


def measure_full(n: int, steps: int, rng: np.random.Generator, rho: float, *, max_num_seqs: int, max_tokens: int,
                 all_run: bool = False, cache_ratio: float = 1.0, cache_kinds: tuple[str, ...] = ("hidden",),
                 policy_options: dict | None = None) -> dict:
    """The decision time (``SchedulerOutput.schedule_time_s``: all of ``Scheduler.schedule()``) of
    ``steps`` consecutive engine steps at ``n`` candidates, after the first one (every waiting
    request new to the policy), which is reported apart."""
    if all_run:
        max_num_seqs, max_tokens = n, 64 * n
    scenario = Scenario(n, rng, rho, max_num_seqs, max_tokens, cache_ratio, cache_kinds, policy_options)
    sched = scenario.sim.scheduler
    first_ms, times, scheduled, running = None, [], [], []
    for k in range(steps + 1):
        num_running = len(sched.running)
        out = scenario.step()
        if k == 0:
            first_ms = out.schedule_time_s * 1e3
            continue
        times.append(out.schedule_time_s * 1e3)
        scheduled.append(len(out.chunks))
        running.append(num_running)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)), "first_ms": first_ms,
            "num_running": int(np.median(running)), "num_scheduled": int(np.median(scheduled))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="score + greedy instances timed per size")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="numbers of candidate requests")
    parser.add_argument("--rho-s-per-page", type=float, default=4e-5, help="recompute cost of one page in seconds "
                        "(at 4e-5 the hidden kind does not pay on the simulator's cost model, so apt does not offer it; "
                        "1e-7 offers it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-steps", type=int, default=20, help="engine steps whose decision is timed (0: skip)")
    add_engine_args(parser, "max_num_seqs", "max_num_batched_tokens", "cache_ratio", "cache_kinds",
                    cache_ratio=Default(1.0, "no ceiling binds (0: KV only, apt then prices one kind); "
                                             "int8 kinds cost rho / 20"))
    parser.add_argument("--all-run", action="store_true", help="also time the decision with no batch limit")
    parser.add_argument("--policy-options", type=json.loads, default={},
                        help='apt\'s keyword arguments as JSON, e.g. \'{"write_off_late": false}\'')
    parser.add_argument("--json", type=Path, default=None, help="write results to this file")
    args = parser.parse_args()
    if args.repeats < 1 or args.full_steps < 0:
        parser.error("--repeats must be >= 1 and --full-steps >= 0")
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes must all be >= 2")
    rng = np.random.default_rng(args.seed)
    limits = dict(max_num_seqs=args.max_num_seqs, max_tokens=args.max_num_batched_tokens, cache_ratio=args.cache_ratio,
                  cache_kinds=tuple(args.cache_kinds), policy_options=args.policy_options)

    results = []
    print(f"whole decision: apt, max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}"
          f", {args.full_steps} steps per size (see the module docstring for what each column times)")
    header = (f"{'candidates':>10} {'greedy ms':>10} {'p90':>7} {'paper':>6} {'t/(n log n)':>12} "
              f"{'full ms':>8} {'p90':>7} {'1st sight':>11}")
    print(header + (f" {'all-run ms':>10}" if args.all_run else ""))
    base = None
    for n in args.sizes:
        greedy_ms, greedy_p90 = measure_greedy(n, args.repeats, rng, args.rho_s_per_page)
        per_nlogn = greedy_ms / (n * math.log2(n))
        base = base or per_nlogn
        row = {"num_candidates": n, "score_greedy_ms": greedy_ms, "score_greedy_p90_ms": greedy_p90}
        line = f"{n:>10} {greedy_ms:>10.3f} {greedy_p90:>7.3f} {PAPER_MS.get(str(n), ''):>6} {per_nlogn / base:>12.2f}"
        if args.full_steps:
            full = measure_full(n, args.full_steps, rng, args.rho_s_per_page, **limits)
            row.update(full_decision_ms=full["median_ms"], full_decision_p90_ms=full["p90_ms"],
                       first_sight_ms=full["first_ms"], num_running=full["num_running"],
                       num_scheduled=full["num_scheduled"])
            line += f" {full['median_ms']:>8.3f} {full['p90_ms']:>7.3f} {full['first_ms']:>11.3f}"
            if args.all_run:
                every = measure_full(n, args.full_steps, rng, args.rho_s_per_page, all_run=True, **limits)
                row.update(full_decision_all_run_ms=every["median_ms"], all_run_num_scheduled=every["num_scheduled"])
                line += f" {every['median_ms']:>10.2f}"
        print(line, flush=True)
        results.append(row)
    if args.json is not None:
        header = stamp(threads=None, dtype=None, model=None, simulated=True,
                       note="the real scheduler, pool and policy on the simulator's engine")
        write_json(args.json, {
            "what": {
                "score_greedy_ms": "median ms of ValueWeights.value + urgency + greedy_select on numpy arrays",
                "full_decision_ms": "median ms of all of Scheduler.schedule() with apt (schedule_time_s) over "
                                    "consecutive steps of the simulated engine kept saturated at n candidates: "
                                    "state read, value model, greedy, choice applied (pages, admissions, chunks)",
                "full_decision_p90_ms": "p90 of the same",
                "first_sight_ms": "the first of those decisions: every waiting request new to the policy",
                "full_decision_all_run_ms": "the same with max_num_seqs = n and 64 n tokens (no batch limit)",
            },
            "config": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                       "cache_ratio": args.cache_ratio, "cache_kinds": args.cache_kinds,
                       "rho_s_per_page": args.rho_s_per_page, "repeats": args.repeats,
                       "full_steps": args.full_steps, "seed": args.seed},
            "results": results, "paper_ms": PAPER_MS}, header, indent=2)


if __name__ == "__main__":
    main()

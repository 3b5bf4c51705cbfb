"""Time one adaptive scheduling decision (score + select) against the number of candidate requests.

    python benchmarks/scheduler_overhead.py [--repeats 50] [--json results.json]

(from the repository root, with the package installed or ``PYTHONPATH=.``).

The paper (Apt-Serve, A100 host) reports 0.3 ms for 50 and 10.8 ms for 1,600 candidates. Each
repeat draws a fresh random instance with realistic magnitudes (pending 0..10 s, 1..128 KV pages,
hidden = half rounded up, capacity = 40% of the total KV need) and times only
``compute_values`` + ``greedy_select``. The last column divides the median by n*log2(n) and
normalises it to the first row: it should stay flat or fall if the cost grows no worse than n log n.

The "full ms" column times a whole ``Scheduler.schedule()`` of the ``apt`` policy on the real
scheduler and page pool (fake requests, no model): reading the candidates' state, scoring,
selecting, and applying the choice (allocating pages, admitting, preempting) — what one engine
iteration pays. Half the candidates are running when it is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.scheduler.knapsack import compute_values, greedy_select, urgency

SIZES = (50, 100, 200, 400, 800, 1600, 3200, 6400, 12800)
PAPER_MS = {"50": 0.3, "1600": 10.8}


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


def _decide(inst: dict, urg: np.ndarray) -> None:
    values = compute_values(inst["pending_s"], urg, inst["importance"], inst["mem_kv"],
                            time_weight=1.0, slo_weight=1.0, priority_weight=0.5)
    greedy_select(values, inst["recompute_cost"], inst["mem_kv"], inst["mem_hidden"],
                  inst["hidden_ok"], inst["capacity"])


def measure(n: int, repeats: int, rng: np.random.Generator, rho: float) -> tuple[float, float]:
    """Median and p90 wall time in ms of one decision over ``repeats`` fresh instances."""
    for _ in range(3):  # warm caches and numpy's dispatch
        inst = _instance(rng, n, rho)
        _decide(inst, urgency(0.0, inst["deadline"], 2.0))
    times = []
    for _ in range(repeats):
        inst = _instance(rng, n, rho)
        urg = urgency(0.0, inst["deadline"], 2.0)
        start = time.perf_counter()
        _decide(inst, urg)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times)), float(np.percentile(times, 90))


def measure_full(n: int, repeats: int, rng: np.random.Generator, rho: float) -> float:
    """Median ms of one full apt scheduling decision with ``n`` candidates."""
    from apt_serve_ray.bench.simulator import SimulatedEngine

    times = []
    for _ in range(repeats):
        config = EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False,
                              max_num_seqs=n, max_num_batched_tokens=64 * n)
        prompts = rng.integers(16, 1024, n)
        sim = SimulatedEngine(config, num_pages=int(0.5 * (prompts // 16 + 1).sum()))
        sim.scheduler.policy.rho = rho
        for p in prompts:
            sim.add(int(p), 64)
        sim.now += rng.uniform(0.5, 5.0)
        sim.step()  # admits what fits: about half become running
        for _ in range(n // 2):
            sim.add(int(rng.integers(16, 1024)), 64)
        sim.now += 0.05
        start = time.perf_counter()
        sim.scheduler.schedule(sim.now)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="decisions timed per size")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="numbers of candidate requests")
    parser.add_argument("--rho-s-per-page", type=float, default=4e-5,
                        help="recompute cost of one page in seconds (rho)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-repeats", type=int, default=5, help="full decisions timed per size (0: skip)")
    parser.add_argument("--json", type=Path, default=None, help="write results to this file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes must all be >= 2")

    rng = np.random.default_rng(args.seed)
    results = []
    print(f"{'candidates':>10} {'median ms':>10} {'p90 ms':>8} {'paper ms':>9} {'t/(n log n)':>12} {'full ms':>9}")
    base = None
    for n in args.sizes:
        median_ms, p90_ms = measure(n, args.repeats, rng, args.rho_s_per_page)
        per_nlogn = median_ms / (n * math.log2(n))
        base = base or per_nlogn
        paper = PAPER_MS.get(str(n), "")
        full_ms = measure_full(n, args.full_repeats, rng, args.rho_s_per_page) if args.full_repeats else float("nan")
        print(f"{n:>10} {median_ms:>10.3f} {p90_ms:>8.3f} {paper:>9} {per_nlogn / base:>12.2f} {full_ms:>9.2f}")
        results.append({"num_candidates": n, "median_ms": median_ms, "p90_ms": p90_ms, "full_decision_ms": full_ms})
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "paper_ms": PAPER_MS}, indent=2) + "\n")


if __name__ == "__main__":
    main()

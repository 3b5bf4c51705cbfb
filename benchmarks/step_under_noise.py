"""A step beside other processes' short wake-ups (issue 41, the second core): how much a parallel step
loses to work that takes a few percent of the machine.

    python benchmarks/step_under_noise.py [--threads 1 2] [--dtype float32] \
        [--json docs/benchmarks/engine_speed/step_under_noise_avx2.json]

Through Serve on two cores, the app's processes (proxy, router, engine replica, controllers, GCS, raylet)
wake up ~2,500 times a second and take ~15% of one core at rest. This runs ``ModelRunner.execute`` of a
decode step of one request (400 tokens of context) and of a 384-token prefill, compute threads bound as the
engine process binds them, quiet and then beside ``--noise-procs`` processes that each wake every
``--period-ms`` and spin ``--busy-us`` (by default 16 x 60 us every 6 ms: ~2,700 wake-ups and ~16% of a core,
the idle app's), alternated ``--rounds`` times; the median step of each. One thread is bound to CPU 0 with
the noise kept on the others where there are any, as the replica pins it. If the slowdown is several times
the noise's share of the machine, a preempted thread holds up its partner: every parallel region of the step
(oneDNN's linears split their work evenly ahead of time) waits for its slowest thread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, fake_step, fill_pages, time_steps
from apt_serve_ray.request import CacheKind
from apt_serve_ray.worker import cpu_affinity

NOISE = """
import os, sys, time
os.sched_setaffinity(0, {cpus})
busy, period = {busy_s}, {period_s}
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(period - busy)
"""


def noise(n: int, busy_us: float, period_ms: float, cpus: set[int]) -> list[subprocess.Popen]:
    code = NOISE.format(cpus=sorted(cpus), busy_s=busy_us * 1e-6, period_s=period_ms * 1e-3)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def median_ms(runner, step, repeats: int) -> float:
    return 1e3 * time_steps(runner, step, repeats, reduce=statistics.median)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--noise-procs", type=int, default=16)
    ap.add_argument("--busy-us", type=float, default=60.0)
    ap.add_argument("--period-ms", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30, help="steps timed per round (the median kept)")
    ap.add_argument("--json", type=Path, default=None)
    add_cache_dir(ap)
    a = ap.parse_args(argv)
    cpus = cpu_affinity.available_cpus()
    llm = build(random_checkpoint(a.shape, a.cache_dir), "fast", True, a.dtype, 256, "cpu")
    runner = llm.llm_engine.runner
    steps = {"decode x1 @ 400": [(400, 1)], "prefill 384": [(384, 384)]}
    fill_pages(runner.storage, CacheKind.KV, 32)
    steps = {k: fake_step(runner, v, CacheKind.KV) for k, v in steps.items()}
    share = a.noise_procs * a.busy_us * 1e-3 / a.period_ms  # cores the noise takes
    rows = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        bound = cpus[:threads]
        cpu_affinity.bind_compute_threads(threads, True, bound)
        others = set(cpus[threads:]) or set(cpus)  # one thread: the noise kept off its CPU, as the replica does
        for label, step in steps.items():
            quiet, noisy = [], []
            for _ in range(a.rounds):
                quiet.append(median_ms(runner, step, a.repeats))
                procs = noise(a.noise_procs, a.busy_us, a.period_ms, others)
                try:
                    time.sleep(0.5)
                    noisy.append(median_ms(runner, step, a.repeats))
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
            q, n = statistics.median(quiet), statistics.median(noisy)
            row = {"threads": threads, "step": label, "quiet_ms": q, "noisy_ms": n, "slowdown": n / q - 1,
                   "noise_cores": share, "noise_share_of_machine": share / len(cpus),
                   "noise_on_cpus": sorted(others), "quiet_rounds": quiet, "noisy_rounds": noisy}
            rows.append(row)
            print(f"{threads} thread(s) {label:16s} quiet {q:7.2f} ms  beside noise {n:7.2f} ms  "
                  f"(+{100 * row['slowdown']:.0f}%; the noise: {share:.2f} of a core on CPUs {sorted(others)}, "
                  f"{100 * share / len(cpus):.0f}% of the machine)", flush=True)
    if a.json:
        print("wrote", write_json(a.json, {"rows": rows, "args": {k: str(v) for k, v in vars(a).items()}},
                                  stamp(threads=a.threads, dtype=a.dtype, model=a.shape, simulated=False)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

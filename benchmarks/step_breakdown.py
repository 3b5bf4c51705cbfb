"""Where a step's time goes (issue 41, item 1): per dtype and thread count, decode steps of 1, 8 and 32
requests and a 512-token prefill chunk beside 16 decodes: its parts (batch preparation, the forward pass, the
lm-head, sampling) by wall time, and its ops by kind (linear layers, attention, the rest).

    python benchmarks/step_breakdown.py [--dtypes bfloat16 float32] [--threads 1 2] [--shape opt-125m]
                                        [--json docs/benchmarks/engine_speed/step_breakdown.json]

Each cell: ``ModelRunner.execute`` of that step (the whole step the engine runs, scheduling aside) on a
random-weight checkpoint, the fastest of ``--repeats`` timings (interference only adds time); its parts timed
by ``bench.steps.StepTimers`` in the fastest of those runs; then the same step under torch.profiler, its ops'
self times summed by group (``bench.steps.OP_GROUPS``), as shares of all ops' time (the profiler adds time to
every op and its own start and stop, so it gives shares, not a wall-time split). "Python" is the step's wall
time less what the ops took by the profiler's count, an estimate from below (the profiler's cost per op is
in the ops' share): per-layer glue, building the batch's tensors, sampling's bookkeeping.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import StepTimers, build, fake_step, fill_pages, group_ops, op_table, time_step
from apt_serve_ray.request import CacheKind

CONTEXT = 400
GROUPS = {"linear layers (incl. lm-head)": "linears", "attention (kernels / sdpa / bmm / softmax)": "attention"}


def shapes(runner) -> dict:
    """label -> a SchedulerOutput: (context after the step, tokens computed) per request."""
    out = {f"decode x{b}": [(CONTEXT, 1)] * b for b in (1, 8, 32)}
    out["512 chunk + 16 decodes"] = [(512, 512)] + [(CONTEXT, 1)] * 16
    pages = sum(runner.layout.num_pages_for(c, CacheKind.KV) for c, _ in out["decode x32"])
    fill_pages(runner.storage, CacheKind.KV, pages)
    return {label: fake_step(runner, shape, CacheKind.KV) for label, shape in out.items()}


def profile(runner, step, repeats: int) -> dict:
    """ms per step by op group (profiled)."""
    out = {"linears": 0.0, "attention": 0.0, "other ops": 0.0}
    for name, ms in group_ops(op_table(lambda: runner.execute(step), repeats)).items():
        out[GROUPS.get(name, "other ops")] += ms
    return out


def timed_parts(runner, step, repeats: int) -> tuple[float, dict]:
    """(fastest step seconds, its parts in seconds) over ``repeats`` timed runs."""
    timers = StepTimers.on(runner)
    best, parts = float("inf"), {}
    for _ in range(repeats):
        t = time_step(runner, step)
        taken = timers.take()
        if t < best:
            best, parts = t, taken
    for name in ("_prepare",):
        runner.__dict__.pop(name, None)
    runner.model.__dict__.pop("forward", None)
    runner.model.__dict__.pop("compute_logits", None)
    runner.sampler.__dict__.pop("sample", None)
    return best, parts


def run(args) -> list[dict]:
    path = random_checkpoint(args.shape, args.cache_dir)
    cells = []
    for dtype in args.dtypes:
        llm = build(path, "fast", True, dtype, args.num_pages, "cpu")
        runner = llm.llm_engine.runner
        steps = shapes(runner)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for label, step in steps.items():
                runner.execute(step)  # warm-up
                best, parts = timed_parts(runner, step, args.repeats)
                ops = profile(runner, step, 3)
                total = sum(ops.values())
                cells.append({"dtype": dtype, "threads": threads, "step": label, "step_ms": best * 1e3,
                              "parts_ms": {k.removesuffix("_s"): v * 1e3 for k, v in parts.items()},
                              "op_share": {k: v / total for k, v in ops.items()},
                              "python_ms_at_least": max(0.0, best * 1e3 - total)})
                print(row(cells[-1]), flush=True)
        del llm, runner
    return cells


def row(c: dict) -> str:
    p, o = c["parts_ms"], c["op_share"]
    return (f"{c['dtype']:<9} {c['threads']:>2}t {c['step']:<24} {c['step_ms']:8.2f} ms | "
            + " ".join(f"{p.get(k, 0.0):7.2f}" for k in ("prepare", "forward", "logits", "sample"))
            + " | " + " ".join(f"{o[k]:6.1%}" for k in ("linears", "attention", "other ops"))
            + f" | {c['python_ms_at_least']:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--shape", default="opt-125m")
    p.add_argument("--num-pages", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path)
    add_cache_dir(p)
    args = p.parse_args()
    print(f"{'dtype':<9} {'thr':>3} {'step':<24} {'step':>11} | {'prepare':>7} {'forward':>7} {'logits':>7} "
          f"{'sample':>7} | {'linear':>6} {'attn':>6} {'other':>6} | python >= (ms)")
    cells = run(args)
    if args.json:
        header = stamp(threads=args.threads, dtype=args.dtypes, model=args.shape, simulated=False, context=CONTEXT)
        print("written:", write_json(args.json, {"cells": cells}, header))


if __name__ == "__main__":
    main()

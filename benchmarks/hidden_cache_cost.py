"""What the hidden-state cache costs per decode step: all-KV vs all-hidden batches, beside a FLOP model.

    python benchmarks/hidden_cache_cost.py [--quick] [--threads 1] [--json out.json]

(from the repository root, with the package installed or ``PYTHONPATH=.``).

On the random-weight OPT-125m-shape checkpoint in bfloat16 (built once under ``--cache-dir``), for
every context length L (128 .. 2048, powers of two; ``--quick`` drops 2048) it:

1. admits 32 requests of about L prompt tokens with ``cache_ratio=1.0`` (every request hidden) and
   prefills them (each prefill step takes whole prompts only, so no chunk is split);
2. times steady-state decode steps of the first B = 32, 8, 1 of them (hidden);
3. upgrades all of them to KV in place (hidden -> KV, one projection per token: a fraction of a
   second prefill) and times the same batches again (KV).

A small benchmark policy (installed with ``llm.set_scheduler``) decides which requests run each
step, so both kinds see the same requests at (nearly) the same contexts; the context each step
actually attends over is recorded and used below. A point is the fastest of ``--steps`` steps,
timed in this process's CPU time when torch runs one thread (the default: the cores are shared,
and CPU time leaves out the time other processes held them), in wall time otherwise.

FLOP model of the extra work (SPEC section 1): a hidden request with context L projects K and V for
all L tokens in every layer, ``2 (K, V) * 2 (mul+add) * L * hidden^2 = 4 * L * hidden^2`` FLOPs per
layer, ``4 * hidden^2 * num_layers`` (= 28.3 MFLOP for OPT-125m) per context token per step. It is
turned into seconds with this machine's measured bf16 GEMM rate for that projection shape
([B*L, hidden] x [hidden, 2*hidden]). The hidden path also gathers x (half the bytes of K+V)
instead of K and V, so the measured extra can come out a little below the model.

``rho`` is ``apt_serve_ray.worker.calibration.calibrate_rho`` on the same runner: the time to recompute one
KV page (block_size tokens) of K/V in all layers, the figure the adaptive scheduler prices with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.bench.engine_args import ONE_THREAD, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.worker.calibration import calibrate_rho
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.policies.base import admit_waiting
BATCHES = (32, 8, 1)  # measured in this order; the largest must come first (it admits the requests)
CONTEXTS = (128, 256, 512, 1024, 2048)


class BenchPolicy:
    """Does exactly what the benchmark says: prefill (whole prompts, in the given kind), decode a
    fixed set of requests, or upgrade every hidden request. Not a serving policy."""

    name = "bench"

    def __init__(self) -> None:
        self.mode = "idle"
        self.kind = CacheKind.HIDDEN
        self.batch: list = []

    def schedule(self, ctx) -> None:
        if self.mode == "prefill":
            for r in list(ctx.running):
                if r.num_output_tokens == 0 and r.num_tokens_to_compute <= ctx.token_budget:
                    ctx.schedule(r, r.num_tokens_to_compute)
            admit_waiting(ctx, ctx.waiting, chunked=False, kind_for=lambda r: self.kind)
        elif self.mode == "decode":
            for r in self.batch:
                if not ctx.schedule(r, 1):
                    raise RuntimeError("benchmark: out of pages or budget in a decode step")
        elif self.mode == "upgrade":
            for r in list(ctx.running):
                if r.kind is CacheKind.HIDDEN and not ctx.upgrade(r):
                    raise RuntimeError("benchmark: out of pages for the upgrade")


def _clock():
    """The cores are shared with other work: with one torch thread all compute runs on this thread,
    so its CPU time is the step's cost without the time other processes held the core. With more
    threads, wall time (CPU time would add up the threads)."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def gemm_gflops(rows: int, hidden: int, dtype, cache: dict) -> float:
    """Measured rate of the K/V projection GEMM [rows, hidden] x [hidden, 2*hidden] (capped at 8192
    rows, where the rate has long saturated); the best of three trials."""
    rows = max(1, min(rows, 8192))
    if rows not in cache:
        clock = _clock()
        a = torch.randn(rows, hidden, dtype=dtype)
        w = torch.randn(2 * hidden, hidden, dtype=dtype)
        for _ in range(2):
            F.linear(a, w)
        n = max(3, min(50, int(1e9 / (4 * rows * hidden * hidden))))
        best = float("inf")
        for _ in range(3):
            t = clock()
            for _ in range(n):
                F.linear(a, w)
            best = min(best, clock() - t)
        cache[rows] = 4 * rows * hidden * hidden * n / best / 1e9
    return cache[rows]


def time_decode(llm, policy, batch, num_steps: int) -> dict:
    """Minimum over ``num_steps`` decode steps (noise from other processes only ever adds time)."""
    engine = llm.llm_engine
    clock = _clock()
    policy.mode, policy.batch = "decode", batch
    engine.step()  # warm-up for this shape
    steps, walls, contexts = [], [], []
    for _ in range(num_steps):
        contexts.append(statistics.mean(r.num_computed_tokens + 1 for r in batch))
        c, w = clock(), time.perf_counter()
        engine.step()
        steps.append(clock() - c)
        walls.append(time.perf_counter() - w)
    policy.mode = "idle"
    return {"step_s": min(steps), "steps_s": steps, "wall_s": walls, "context": statistics.mean(contexts)}


def run_context(llm, policy, length: int, num_steps: int, max_batch: int, seed: int) -> dict:
    engine = llm.llm_engine
    # Leave room for every decode step of both kinds inside the model's context.
    tokens_per_request = 2 * len(BATCHES) * (num_steps + 1) + 2
    prompt_len = length - tokens_per_request
    g = torch.Generator().manual_seed(seed + length)
    prompts = torch.randint(100, engine.vocab_size, (max_batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=tokens_per_request, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]

    t = time.perf_counter()
    policy.mode, policy.kind = "prefill", CacheKind.HIDDEN
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    prefill_s = time.perf_counter() - t
    if any(r.kind is not CacheKind.HIDDEN for r in requests):
        raise RuntimeError("benchmark: a request did not get the hidden kind")

    out = {"length": length, "prompt_len": prompt_len, "prefill_s": prefill_s, "hidden": {}, "kv": {}}
    for b in BATCHES:
        out["hidden"][b] = time_decode(llm, policy, requests[:b], num_steps)
    policy.mode = "upgrade"
    t = time.perf_counter()
    engine.step()
    out["upgrade_s"] = time.perf_counter() - t
    out["upgrade_tokens"] = sum(r.num_computed_tokens for r in requests)
    if any(r.kind is not CacheKind.KV for r in requests):
        raise RuntimeError("benchmark: a request was not upgraded to KV")
    for b in BATCHES:
        out["kv"][b] = time_decode(llm, policy, requests[:b], num_steps)
    for r in requests:
        engine.abort_request(r.request_id)
    engine.cache.pool.check_integrity()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cache_dir(ap)
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps per point (minimum)")
    add_engine_args(ap, "num_threads", num_threads=ONE_THREAD)
    ap.add_argument("--quick", action="store_true", help="drop the largest context (2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    contexts = sorted(args.contexts)
    if args.quick and len(contexts) > 1:
        contexts = contexts[:-1]
    torch.set_num_threads(args.num_threads)
    max_batch = max(BATCHES)

    path = random_checkpoint("opt-125m", args.cache_dir)
    block = 16
    # Upgrading holds both kinds at once: KV pages for every request plus its hidden pages.
    num_pages = int(max_batch * (-(-max(contexts) // block) + 2) * 1.5) + 64
    policy = BenchPolicy()
    llm = LLM(path, dtype="bfloat16", cache_ratio=1.0, num_pages=num_pages, max_num_seqs=max_batch,
              max_num_batched_tokens=max(4096, max(contexts)), block_size=block, num_threads=args.num_threads)
    llm.set_scheduler(policy)
    engine = llm.llm_engine
    shape = engine.runner.model.shape
    if not engine.layout.hidden_saves_memory:
        raise SystemExit("this model's hidden cache saves no memory; the benchmark needs an MHA model")
    flops_per_token = 4 * shape.hidden_size**2 * shape.num_layers

    t = time.perf_counter()
    rho = calibrate_rho(engine.runner)
    print(f"calibrated rho: {rho.seconds_per_page * 1e3:.3f} ms per KV page ({rho.tokens_per_page} tokens) = "
          f"{rho.seconds_per_token * 1e6:.1f} us/token + {rho.intercept_s * 1e3:.2f} ms per request "
          f"(r2 {rho.r2:.4f}, {time.perf_counter() - t:.2f} s)", flush=True)
    gf_cache: dict[int, float] = {}
    peak = gemm_gflops(4096, shape.hidden_size, torch.bfloat16, gf_cache)
    print(f"bf16 K/V-projection GEMM at {args.num_threads} thread(s): {peak:.0f} GFLOP/s (4096 rows)", flush=True)

    raw, rows = [], []
    for length in contexts:
        t = time.perf_counter()
        res = run_context(llm, policy, length, args.steps, max_batch, args.seed)
        raw.append(res)
        print(f"L={length}: prefill {res['prefill_s']:.1f} s, upgrade {res['upgrade_s'] * 1e3:.0f} ms "
              f"for {res['upgrade_tokens']} tokens, total {time.perf_counter() - t:.1f} s", flush=True)
        for b in BATCHES:
            h, kv = res["hidden"][b], res["kv"][b]
            ctx = (h["context"] + kv["context"]) / 2
            extra = h["step_s"] - kv["step_s"]
            gf = gemm_gflops(int(b * ctx), shape.hidden_size, torch.bfloat16, gf_cache)
            model_s = flops_per_token * b * ctx / (gf * 1e9)
            rows.append({
                "batch": b, "length": length, "context": ctx, "kv_step_ms": kv["step_s"] * 1e3,
                "hidden_step_ms": h["step_s"] * 1e3, "extra_ms": extra * 1e3,
                "extra_us_per_token": extra / (b * ctx) * 1e6, "flop_model_ms": model_s * 1e3,
                "flop_model_us_per_token": model_s / (b * ctx) * 1e6, "gemm_gflops": gf,
                "measured_over_model": extra / model_s,
                "rho_predicted_ms": b * rho.recompute_seconds(int(ctx)) * 1e3,
                "hidden_over_kv": h["step_s"] / kv["step_s"],
            })

    print()
    print(f"{'B':>3} {'L':>5} {'ctx':>6} {'KV ms':>9} {'hidden ms':>10} {'x':>6} {'extra ms':>9} "
          f"{'us/tok':>7} {'model us/tok':>12} {'meas/model':>10} {'rho-pred ms':>11}")
    for r in sorted(rows, key=lambda r: (r["batch"], r["length"])):
        print(f"{r['batch']:>3} {r['length']:>5} {r['context']:>6.0f} {r['kv_step_ms']:>9.1f} "
              f"{r['hidden_step_ms']:>10.1f} {r['hidden_over_kv']:>5.1f}x {r['extra_ms']:>9.1f} "
              f"{r['extra_us_per_token']:>7.1f} {r['flop_model_us_per_token']:>12.1f} "
              f"{r['measured_over_model']:>10.2f} {r['rho_predicted_ms']:>11.1f}")
    big = [r for r in rows if r["batch"] * r["context"] >= 4096]
    fit_rows = big or rows
    per_token = statistics.median(r["extra_us_per_token"] for r in fit_rows)
    model_per_token = flops_per_token / (peak * 1e9) * 1e6
    print(f"\nFLOP model: 4 * hidden^2 * layers = {flops_per_token / 1e6:.1f} MFLOP per hidden context token per step;"
          f" at {peak:.0f} GFLOP/s that is {model_per_token:.1f} us/token")
    print(f"measured extra (median over points with B*ctx >= 4096): {per_token:.1f} us/token "
          f"= {per_token * block / 1e3:.3f} ms per {block}-token page")
    print(f"calibrated rho: {rho.seconds_per_token * 1e6:.1f} us/token = {rho.seconds_per_page * 1e3:.3f} ms per page")

    if args.json is not None:
        doc = {
            "model": "opt-125m-shape random weights", "dtype": "bfloat16", "threads": args.num_threads,
            "block_size": block, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "flop_model": "extra FLOPs per hidden request per decode step = 4 * L * hidden^2 * num_layers",
            "flops_per_context_token": flops_per_token, "gemm_gflops_4096_rows": peak,
            "gemm_gflops_by_rows": gf_cache,
            "flop_model_us_per_token": model_per_token,
            "measured_extra_us_per_token": per_token,
            "rho": {"seconds_per_page": rho.seconds_per_page, "seconds_per_token": rho.seconds_per_token,
                    "intercept_s": rho.intercept_s, "tokens_per_page": rho.tokens_per_page, "r2": rho.r2,
                    "points": rho.points, "wall_s": rho.wall_s},
            "rows": rows,
            "raw": [{**r, "hidden": {str(b): v for b, v in r["hidden"].items()},
                     "kv": {str(b): v for b, v in r["kv"].items()}} for r in raw],
            "clock": "process CPU time (1 thread)" if args.num_threads == 1 else "wall",
            "torch": torch.__version__, "load_average": os.getloadavg()[0],
        }
        header = stamp(threads=args.num_threads, dtype="bfloat16", model="opt-125m (random weights)",
                       simulated=False)
        write_json(args.json, doc, header, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the tier below memory costs against recompute, per page, on this machine.

    python benchmarks/swap_cost.py [--threads 1] [--swap-dir DIR] [--json out.json]

On the random-weight OPT-125m shape in bf16 and fp32 with a 1 GiB tier: the transfer cost the engine
measured at start and the same for 32 and 128 pages (the first pass into fresh slots apart), against
recomputing the pages (the step-time model ``Scheduler.should_swap`` prices with, and a timed
prefill), with rho for scale; fastest of a few repeats. Results: docs/benchmarks.md ("Cache kinds").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from apt_serve_ray import LLM
from apt_serve_ray.bench.engine_args import ONE_THREAD, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import fake_step, time_steps
from apt_serve_ray.worker.calibration import calibrate_rho, step_time_model
from apt_serve_ray.request import CacheKind

CONTEXT = 512  # tokens recomputed / pages moved in the direct comparison (32 pages of 16 tokens)


def _time_transfer(swap, storage, pages: list[int], repeats: int) -> dict:
    slots = swap.allocate(len(pages), "__bench__")
    try:
        t = time.perf_counter()
        swap.copy_out(storage, pages, slots)  # fresh slots: first touch of the file's blocks
        cold_out = time.perf_counter() - t
        best_out = best_in = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            swap.copy_out(storage, pages, slots)
            t1 = time.perf_counter()
            swap.copy_in(storage, slots, pages)
            t2 = time.perf_counter()
            best_out, best_in = min(best_out, t1 - t0), min(best_in, t2 - t1)
    finally:
        swap.free(slots, "__bench__")
    n, size = len(pages), swap.layout.bytes_per_page
    return {"pages": n, "cold_out_ms_per_page": cold_out / n * 1e3, "out_ms_per_page": best_out / n * 1e3,
            "in_ms_per_page": best_in / n * 1e3, "out_gb_s": size * n / best_out / 1e9,
            "in_gb_s": size * n / best_in / 1e9}


def _time_prefill(engine, n: int, repeats: int) -> float:
    lay = engine.layout
    pages = engine.cache.pool.allocate(lay.num_pages_for(n, CacheKind.KV), CacheKind.KV, "__bench__")
    try:
        return time_steps(engine.runner, fake_step(engine.runner, [(n, n)], CacheKind.KV, pages), repeats)
    finally:
        engine.cache.pool.free(pages, "__bench__")


def measure(path: str, dtype: str, args) -> dict:
    llm = LLM(path, dtype=dtype, num_pages=512, swap_space=1.0, swap_dir=args.swap_dir,
              max_num_batched_tokens=4096, num_threads=args.num_threads, calibrate_rho=False)
    engine = llm.llm_engine
    swap, storage, lay = engine.swap, engine.runner.storage, engine.layout
    start = swap.transfer
    transfers = [_time_transfer(swap, storage, list(range(n)), args.repeats) for n in (32, 128)]
    model = step_time_model(engine.runner, pool=engine.cache.pool)
    pages = lay.num_pages_for(CONTEXT, CacheKind.KV)
    model_s = model.predict(CONTEXT, CONTEXT) - model.predict(0, 0)
    prefill_s = _time_prefill(engine, CONTEXT, args.repeats)
    rho = calibrate_rho(engine.runner)
    return {
        "dtype": dtype, "bytes_per_page": lay.bytes_per_page, "tokens_per_page": lay.block_size,
        "startup": {"pages": 8, "out_ms_per_page": start.out_s_per_page * 1e3,
                    "in_ms_per_page": start.in_s_per_page * 1e3,
                    "out_gb_s": start.gb_per_s()[0], "in_gb_s": start.gb_per_s()[1]},
        "transfers": transfers,
        "recompute": {"context": CONTEXT, "model_ms_per_page": model_s / pages * 1e3,
                      "prefill_ms_per_page": prefill_s / pages * 1e3, "step_model_r2": model.r2},
        "round_trip_ms_per_page": (start.out_s_per_page + start.in_s_per_page) * 1e3,
        "rho_ms_per_page_per_decode_step": rho.seconds_per_page * 1e3,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cache_dir(ap)
    add_engine_args(ap, "num_threads", num_threads=ONE_THREAD)
    ap.add_argument("--swap-dir", default=None, help="where the tier's file goes (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    path = random_checkpoint("opt-125m", args.cache_dir)
    results = []
    for dtype in ("bfloat16", "float32"):
        r = measure(path, dtype, args)
        results.append(r)
        s, rc = r["startup"], r["recompute"]
        print(f"{dtype}: page {r['bytes_per_page'] / 1024:.0f} KiB; swap out {s['out_ms_per_page']:.3f} ms/page "
              f"({s['out_gb_s']:.2f} GB/s), in {s['in_ms_per_page']:.3f} ms/page ({s['in_gb_s']:.2f} GB/s); "
              f"recompute {rc['model_ms_per_page']:.2f} ms/page (step model), {rc['prefill_ms_per_page']:.2f} "
              f"(timed {CONTEXT}-token prefill); rho {r['rho_ms_per_page_per_decode_step']:.3f} ms/page/step",
              flush=True)
        for t in r["transfers"]:
            print(f"    {t['pages']:4d} pages: out {t['out_ms_per_page']:.3f} ms/page ({t['out_gb_s']:.2f} GB/s; "
                  f"cold {t['cold_out_ms_per_page']:.3f}), in {t['in_ms_per_page']:.3f} ({t['in_gb_s']:.2f} GB/s)")
    if args.json:
        header = stamp(threads=args.num_threads, dtype=["bfloat16", "float32"], model="opt-125m (random weights)",
                       simulated=False)
        write_json(args.json, {"threads": args.num_threads, "results": results}, header, indent=2)


if __name__ == "__main__":
    main()

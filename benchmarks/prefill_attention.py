"""Prefill attention alone, path against path: our AVX-512 kernel over the pages in place, and torch's
SDPA over the pages gathered into one tile (the CPU backend's two prefill paths, ``prefill_path``).

A chunk of Q queries at position S attends to S + Q keys of one layer; the shapes are a fresh prompt
(S = 0) and a chunk deep into a document, at the heads of OPT-125m (12 x 64) and SmolLM2-135M (9 query
heads over 3 KV heads of 64). Fastest of ``--repeats``, the paths interleaved; GFLOP/s counts the
causal half of QK^T and PV (4 x D flops per visible query-key pair). Issue 41, item 2; the results:
docs/benchmarks.md ("Prefill attention").

    python benchmarks/prefill_attention.py --threads 1 2 --dtypes bfloat16 float32 \\
        --json docs/benchmarks/engine_speed/prefill_attention.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from apt_serve_ray.attention.cpu_backend import gather_kv_pages, sdpa_prefill
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.kernels import cpu_attention

HEADS = {"opt-125m": (12, 12, 64), "smollm2-135m": (9, 3, 64)}  # query heads, KV heads, head dim
SHAPES = ((384, 0), (512, 0), (512, 1024))  # (queries, start position)
PAGE = 16


def visible_pairs(queries: int, start: int) -> int:
    return queries * start + queries * (queries + 1) // 2


def case(dtype, heads: int, kv_heads: int, dim: int, queries: int, start: int):
    g = torch.Generator().manual_seed(queries * 31 + start)
    ctx = start + queries
    pages = (ctx + PAGE - 1) // PAGE
    kv = torch.randn(pages + 3, PAGE, 2, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(pages + 3, generator=g)[:pages].to(torch.int32)  # scattered, as a live pool
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    return q, kv, table


def time_paths(dtype, heads, kv_heads, dim, queries, start, repeats: int) -> dict:
    q, kv, table = case(dtype, heads, kv_heads, dim, queries, start)
    scale, ctx = dim ** -0.5, start + queries

    def kernel():
        return cpu_attention.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], table, start, scale)

    def sdpa():
        k, v = gather_kv_pages(kv, table, ctx)
        return sdpa_prefill(q, k, v, start, scale)

    paths = {"sdpa": sdpa}
    if cpu_attention.prefill_supported(dim, dtype):
        paths = {"kernel": kernel, **paths}
    outs = {name: fn().float() for name, fn in paths.items()}  # warm-up, and the two must agree
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    flops = 4.0 * dim * heads * visible_pairs(queries, start)
    row = {name: {"ms": s * 1e3, "gflops": flops / s / 1e9} for name, s in best.items()}
    if "kernel" in outs:
        row["max_abs_diff"] = float((outs["kernel"] - outs["sdpa"]).abs().max())
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--models", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not cpu_attention.is_available():
        raise SystemExit("the C++ kernels did not build here (see the README's set-up)")
    rows = []
    print(f"{'threads':>7} {'dtype':>9} {'model':>13} {'Q':>5} {'start':>6} {'kernel ms':>10} {'GFLOP/s':>8} "
          f"{'sdpa ms':>8} {'GFLOP/s':>8} {'sdpa/kernel':>11}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for model in args.models:
                heads, kv_heads, dim = HEADS[model]
                for queries, start in SHAPES:
                    r = time_paths(dtype, heads, kv_heads, dim, queries, start, args.repeats)
                    rows.append(dict(threads=threads, dtype=dtype_name, model=model, queries=queries, start=start, **r))
                    k = r.get("kernel", {"ms": float("nan"), "gflops": float("nan")})
                    print(f"{threads:>7} {dtype_name:>9} {model:>13} {queries:>5} {start:>6} {k['ms']:>10.2f} "
                          f"{k['gflops']:>8.0f} {r['sdpa']['ms']:>8.2f} {r['sdpa']['gflops']:>8.0f} "
                          f"{r['sdpa']['ms'] / k['ms']:>10.2f}x", flush=True)
    if args.json:
        header = stamp(threads=args.threads, dtype=args.dtypes, model=args.models, simulated=False)
        print("written:", write_json(args.json, {"rows": rows}, header))


if __name__ == "__main__":
    main()

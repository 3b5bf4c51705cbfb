"""One linear layer with weights kept quantized, against the same layer at full width (issue 43): our int4 / int8
kernels, and the weight widened into a bf16 scratch then multiplied by oneDNN's GEMM (the path prefill-sized
batches take, ``quant.WIDEN_ROWS``), per row count, on SmolLM2's and TinyLlama's layer shapes.

    python benchmarks/woq_layers.py [--rows 16 32 64 128 512] [--threads 1] [--json docs/benchmarks/woq_layers.json]

Each cell: the fastest of ``--repeats`` calls, as a ratio to the full-width layer (bf16, prepacked for oneDNN) on
the same input; "widen" alone is the scratch's cost.
"""

from __future__ import annotations

import argparse

import torch

from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.kernels import cpu_attention
from apt_serve_ray.models.linear import Linear, fastest
from apt_serve_ray.models.quant import Int4Linear, Int8Linear, native_int8_kernel

SHAPES = {"smollm2 qkv": (960, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
          "tinyllama gate_up": (11264, 2048), "tinyllama down": (2048, 5632)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=[16, 32, 64, 128, 512])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cpu_attention.load()
    if not native_int8_kernel():
        raise SystemExit("our kernels need AVX-512 BF16: this CPU has torch's only")
    torch.set_num_threads(args.threads)
    ops = torch.ops.apt_serve
    results = []
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16()
        full, int4, int8 = Linear(w), Int4Linear(w), Int8Linear(w)
        scratch = torch.empty(k, int4.packed.shape[0] * 16, dtype=torch.bfloat16)  # as quant._scratch, reused

        def int4_widened(x):
            ops.woq_int4_dequant_t(int4.packed, int4.dm, scratch)
            return x @ scratch

        def int8_widened(x):
            ops.woq_int8_dequant_t(int8.packed, int8.scale32, scratch)
            return x @ scratch

        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            t = {"full": fastest(lambda: full(x), args.repeats),
                 "int4 kernel": fastest(lambda: ops.woq_int4_linear(x, int4.packed, int4.dm, None, n), args.repeats),
                 "int4 widened": fastest(lambda: int4_widened(x), args.repeats),
                 "int4 widen alone": fastest(lambda: ops.woq_int4_dequant_t(int4.packed, int4.dm, scratch), args.repeats),
                 "int8 kernel": fastest(lambda: ops.woq_int8_linear(x, int8.packed, int8.scale32, None, n), args.repeats),
                 "int8 widened": fastest(lambda: int8_widened(x), args.repeats)}
            row = {"shape": label, "n": n, "k": k, "rows": m, "full_ms": t["full"] * 1e3,
                   **{key: t[key] / t["full"] for key in t if key != "full"}}
            results.append(row)
            print(f"{label:18s} [{n}x{k}] rows {m:4d}: full {row['full_ms']:.3f} ms  "
                  + "  ".join(f"{key} {row[key]:.2f}x" for key in t if key != "full"), flush=True)
    if args.json:
        header = stamp(threads=args.threads, dtype="bfloat16", model="layer shapes of SmolLM2-135M and TinyLlama-1.1B",
                       simulated=False, rows=args.rows, repeats=args.repeats)
        print("written:", write_json(args.json, {"results": results}, header))


if __name__ == "__main__":
    main()

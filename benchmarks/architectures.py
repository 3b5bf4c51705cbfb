"""Decode-step time of every architecture we serve, at one shape, side by side (issue 29).

    python benchmarks/architectures.py [--batches 1 8 32] [--context 400] [--dtype float32] \\
        [--json docs/benchmarks/architectures.json]

Each architecture's random-weight checkpoint at OPT-125m's sizes (``<arch>-125m`` in
``apt_serve_ray.models.checkpoints``: 768 wide, 12 layers, 12 heads of 64, multi-head, 3072-wide MLP; OPT
itself as ``opt-125m``) is loaded through the engine, and one whole engine step
(``ModelRunner.execute``: batch preparation, forward, lm-head, sampling; KV pages on the device's
fast attention backend) is timed on decode batches of B requests with ``--context`` tokens each, as
``decode_step.py`` does. The architectures are interleaved per batch (round-robin, fastest of
``--repeats``), so a slow phase of a shared machine hits them alike; the table gives each one's time
over Llama's. What differs: OPT (LayerNorm, ReLU MLP, learned positions) and the Llama family (RMSNorm,
gated SiLU MLP, RoPE; Qwen2 biases, Qwen3 q/k norms, Phi-3 partial rotary), Gemma's (1 + w) norms and
GeLU-tanh MLP, Gemma 2's extra norms, capped scores and logits and Gemma 3's q/k norms: a Gemma 2 / 3
local (sliding-window) layer, and every Gemma 2 layer (soft-capped scores), attend through the masked
reference path rather than the C++ kernels (``AttentionBackend._forward_masked``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import ONE_THREAD, Default, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, decode_batch, time_step
from apt_serve_ray.request import CacheKind

ARCHITECTURES = ["llama", "opt", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--architectures", nargs="+", default=ARCHITECTURES, choices=ARCHITECTURES)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=400)
    add_engine_args(p, "dtype", "num_threads", num_threads=ONE_THREAD,
                    dtype=Default("float32", "the architectures side by side in one dtype every CPU runs fast",
                                  ("float32", "bfloat16")))
    p.add_argument("--repeats", type=int, default=5)
    add_cache_dir(p)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    num_pages = max(args.batches) * (-(-args.context // 16)) + 8
    engines = {}
    for arch in args.architectures:
        shape = "opt-125m" if arch == "opt" else f"{arch}-125m"
        path = random_checkpoint(shape, args.cache_dir, dtype=args.dtype)
        engines[arch] = build(path, "fast", True, args.dtype, num_pages, "cpu")
    header = stamp(threads=args.num_threads, dtype=args.dtype, model="<arch>-125m shapes, random weights",
                   simulated=False)
    print(header["machine"], f"dtype {args.dtype}, {args.num_threads} thread(s), context {args.context}, KV pages, "
          "fast backend")
    rows = []
    for batch in args.batches:
        outs = {arch: decode_batch(llm, batch, args.context, CacheKind.KV) for arch, llm in engines.items()}
        best = {arch: float("inf") for arch in engines}
        for arch, llm in engines.items():  # warm-up
            time_step(llm.llm_engine.runner, outs[arch])
        for _ in range(args.repeats):
            for arch, llm in engines.items():
                best[arch] = min(best[arch], time_step(llm.llm_engine.runner, outs[arch]))
        base = best.get("llama")
        for arch in engines:
            rows.append({"architecture": arch, "batch": batch, "step_ms": best[arch] * 1e3,
                         "over_llama": best[arch] / base if base else None})
            ratio = f"{best[arch] / base:5.2f}x" if base else "-"
            print(f"batch {batch:3d}  {arch:12s} {best[arch] * 1e3:8.2f} ms  {ratio} Llama's")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, header)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

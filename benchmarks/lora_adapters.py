"""LoRA adapters in a step (issue 43, item 3): what serving requests of 1, 4 and 8 adapters side by side costs
against the base model alone, step by step.

    python benchmarks/lora_adapters.py [--models smollm2 opt-125m] [--dtype bfloat16] [--rank 16] [--targets all]
                                       [--json docs/benchmarks/lora_adapters.json]

Per model: one engine without adapters (the base) and one holding 8 random adapters of ``--rank`` on every
linear layer PEFT targets (q, k, v, o and the MLP's), written as PEFT folders. ``ModelRunner.execute`` of
decode steps (256 tokens of context a row) and of a 512-token prefill chunk, each row of the LoRA engine's
steps given the adapter its place in the batch says (``--adapters``: how many distinct adapters the rows
cycle through; 0: base-model rows on the LoRA engine, what holding adapters costs a request without one),
interleaved across the engines, the fastest of ``--repeats``; the ratio to the base engine's same step is
the figure (the issue's aim: at most 1.25x the base model's TPOT with 8 adapters in a batch).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from apt_serve_ray import LLM
from apt_serve_ray.bench.adapters import write_random_adapter
from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import decode_batch, fake_step, fill_pages, time_step
from apt_serve_ray.models.loader import DEFAULT_MODEL
from apt_serve_ray.request import CacheKind

MODELS = {"smollm2": None, "opt-125m": "opt-125m"}
TARGETS = {"qv": ("q_proj", "v_proj"), "all": None}


def with_adapters(out, refs: list, k: int):
    """Give the step's rows adapters, cycling through the first ``k`` (0: none)."""
    for i, chunk in enumerate(out.chunks):
        chunk.request.lora = refs[i % k] if k else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all", choices=list(TARGETS),
                   help="qv: q_proj and v_proj (PEFT's default for Llama and OPT); all: every linear layer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    add_cache_dir(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [("decode x1", 1, [0, 1]), ("decode x8", 8, [0, 1, 4, 8]), ("decode x32", 32, [0, 8]),
              ("prefill 512", None, [0, 1])]
    results = {}
    for model in args.models:
        path = random_checkpoint(MODELS[model], args.cache_dir) if MODELS[model] else DEFAULT_MODEL
        common = dict(dtype=args.dtype, num_pages=1024, calibrate_rho=False, enable_watermarks=False,
                      max_num_batched_tokens=4096, max_num_seqs=64, num_threads=args.threads, max_model_len=2048)
        base = LLM(path, **common)
        with tempfile.TemporaryDirectory() as tmp:
            hf_config = base.llm_engine.runner.hf_config
            modules = []
            for j in range(8):
                write_random_adapter(os.path.join(tmp, f"a{j}"), hf_config, args.rank, seed=j,
                                     modules=TARGETS[args.targets])
                modules.append(f"a{j}={os.path.join(tmp, f'a{j}')}")
            lora = LLM(path, **common, lora_modules=tuple(modules), max_loras=8, max_lora_rank=args.rank)
        refs = [lora.llm_engine.runner.lora.ref(f"a{j}") for j in range(8)]
        rows = {}
        for label, batch, ks in shapes:
            def make(llm):
                if batch is None:
                    return fake_step(llm.llm_engine.runner, [(512, 512)])
                return decode_batch(llm, batch, 256, CacheKind.KV)
            steps = {"base": make(base), **{k: with_adapters(make(lora), refs, k) for k in ks}}
            engines = {"base": base, **{k: lora for k in ks}}
            for name, out in steps.items():
                engines[name].llm_engine.runner.execute(out)  # warm-up
            best = {name: float("inf") for name in steps}
            for _ in range(args.repeats):
                for name, out in steps.items():
                    best[name] = min(best[name], time_step(engines[name].llm_engine.runner, out))
            rows[label] = {"base_ms": best["base"] * 1e3,
                           **{f"{k} adapters": {"ms": best[k] * 1e3, "ratio": best[k] / best["base"]} for k in ks}}
            cells = "  ".join(f"{k} adapters {best[k] * 1e3:7.2f} ms ({best[k] / best['base']:.2f}x)" for k in ks)
            print(f"{model:10s} {label:12s} base {best['base'] * 1e3:7.2f} ms  {cells}", flush=True)
        results[model] = {"rows": rows, "slot_mib": lora.llm_engine.runner.lora.nbytes / 2**20}
        print(f"{model:10s} slots: {results[model]['slot_mib']:.1f} MiB for 8 adapters of rank {args.rank} "
              f"({args.targets})")
    if args.json:
        write_json(args.json, {"results": results, "rank": args.rank, "targets": args.targets},
                   stamp(threads=args.threads, dtype=args.dtype, model=" ".join(args.models), simulated=False))


if __name__ == "__main__":
    main()

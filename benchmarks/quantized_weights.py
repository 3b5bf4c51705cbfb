"""Weights kept quantized (``quantization`` int8 / int4, and checkpoints written quantized as GPTQ, AWQ and
compressed-tensors W8A8 / W4A16; issue 43): what they cost in fidelity and buy in memory and step time,
against the same model at full width in the same dtype.

    python benchmarks/quantized_weights.py [--models smollm2 opt-125m tinyllama-1.1b] [--dtypes bfloat16 float32]
                                           [--variants full int8 int4 gptq awq w8a8 w4a16]
                                           [--batches 1 8 32] [--json docs/benchmarks/quantized_weights.json]

Per model and dtype, each engine in turn (full width, then each of ``--variants``; the checkpoint formats are
written by ``models/quantize_checkpoint.py`` from the full-width model, round to nearest in groups of 64):

* fidelity: ``int8_accuracy.py``'s held-out prompts, greedy at full width as the reference; each quantized
  engine teacher-forced on its tokens (logit error, top-1 agreement) and greedy on its own (the share of
  tokens before the first difference). The default model ships as Q4_1, so its int4 run holds the shipped
  4-bit codes, and in float32 should equal the full-width run, which holds them dequantized;
* memory: bytes of the weights (linear layers, embeddings, norms), and the KV tokens the bytes saved hold;
* step time: ``ModelRunner.execute`` of a decode batch of B rows at 256 tokens of context each and of a
  512-token prefill chunk, interleaved across the engines, the fastest of ``--repeats`` (interference only
  adds time); ratios to full width per shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from apt_serve_ray import LLM
from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import decode_batch, fake_step, fill_pages, time_step
from apt_serve_ray.models.base import tensor_bytes
from apt_serve_ray.request import CacheKind

sys.path.insert(0, str(Path(__file__).parent))
from int8_accuracy import PROMPTS, compare, run_kind  # noqa: E402

MODELS = {"smollm2": None, "opt-125m": "opt-125m", "tinyllama-1.1b": "tinyllama-1.1b"}
VARIANTS = ("full", "int8", "int4", "gptq", "awq", "w8a8", "w4a16")
CHECKPOINT_FORMATS = ("gptq", "awq", "w8a8", "w4a16")  # written by quantize_checkpoint.py (groups of 64)


def variant_source(path: str, variant: str, tmp: str) -> tuple[str, str | None]:
    """(the model to load, its ``quantization``) for a variant: full width, quantized at load, or a checkpoint
    written quantized in one of the formats people deploy (round to nearest, groups of 64: SmolLM2 is 576 wide)."""
    if variant not in CHECKPOINT_FORMATS:
        return path, None if variant == "full" else variant
    from apt_serve_ray.models.quantize_checkpoint import quantize_checkpoint

    folder = str(Path(tmp) / variant)
    quantize_checkpoint(path, folder, variant, group_size=64)
    return folder, None


def engine(path: str, quantization, *, dtype: str, num_pages: int, threads: int) -> LLM:
    return LLM(path, dtype=dtype, quantization=quantization, num_pages=num_pages, calibrate_rho=False,
               enable_watermarks=False, max_num_batched_tokens=4096, max_num_seqs=64, num_threads=threads,
               max_model_len=2048)


def step_times(llms: dict, batches: list[int], repeats: int) -> dict:
    """{variant: {shape: seconds}}: decode batches at 256 tokens of context, one 512-token prefill chunk."""
    shapes = {f"decode x{b}": lambda llm, b=b: decode_batch(llm, b, 256, CacheKind.KV) for b in batches}
    shapes["prefill 512"] = lambda llm: _prefill(llm)
    out = {name: {} for name in llms}
    for label, make in shapes.items():
        steps = {name: make(llm) for name, llm in llms.items()}
        for name, llm in llms.items():
            llm.llm_engine.runner.execute(steps[name])  # warm-up
        best = {name: float("inf") for name in llms}
        for _ in range(repeats):
            for name, llm in llms.items():
                best[name] = min(best[name], time_step(llm.llm_engine.runner, steps[name]))
        for name in llms:
            out[name][label] = best[name]
    return out


def _prefill(llm):
    runner = llm.llm_engine.runner
    fill_pages(runner.storage, CacheKind.KV, runner.layout.num_pages_for(512, CacheKind.KV))
    return fake_step(runner, [(512, 512)], CacheKind.KV)


def run_model(name: str, args) -> dict:
    path = "smollm2-135m-instruct" if MODELS[name] is None else random_checkpoint(MODELS[name], args.cache_dir)
    result = {"model": name, "dtypes": {}}
    tmp = tempfile.TemporaryDirectory()
    sources = {v: variant_source(path, v, tmp.name) for v in args.variants}
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        llms = {v: engine(*sources[v], dtype=dtype, num_pages=args.num_pages, threads=args.threads)
                for v in args.variants}
        ref = llms["full"].llm_engine
        tok = llms["full"].get_tokenizer()
        prompts = [tok.encode(p) for p in PROMPTS]
        ref_tokens, ref_logits = run_kind(ref, prompts, CacheKind.KV, args.max_tokens)
        rows = {}
        for q in args.variants:
            eng = llms[q].llm_engine
            row = {"weight_bytes": tensor_bytes(eng.runner.model)}
            if q != "full":
                _, tf = run_kind(eng, prompts, CacheKind.KV, args.max_tokens, forced=ref_tokens)
                free, _ = run_kind(eng, prompts, CacheKind.KV, args.max_tokens)
                row.update(compare(ref_tokens, ref_logits, tf, free))
            rows[q] = row
        layout = ref.runner.layout
        full = rows["full"]["weight_bytes"]
        for row in rows.values():
            row["kv_tokens_in_saved_bytes"] = (full - row["weight_bytes"]) // layout.bytes_per_page * layout.block_size
        times = step_times(llms, args.batches, args.repeats)
        for q in args.variants:
            rows[q]["step_s"] = times[q]
        result["dtypes"][dtype] = rows
        print(f"{name} {dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llms, ref
    tmp.cleanup()
    return result


def print_table(results: list[dict]) -> None:
    for res in results:
        for dtype, rows in res["dtypes"].items():
            print(f"\n{res['model']} {dtype}")
            labels = list(rows["full"]["step_s"])
            head = (f"{'weights':<8} {'MB':>7} {'KV tokens':>10} {'TF top1':>8} {'greedy prefix':>13} {'max err':>8} "
                    + " ".join(f"{lab:>14}" for lab in labels))
            print(head)
            print("-" * len(head))
            base = rows["full"]["step_s"]
            for q, row in rows.items():
                cells = " ".join(f"{row['step_s'][lab] * 1e3:7.2f} {row['step_s'][lab] / base[lab]:5.2f}x"
                                 for lab in labels)
                fid = (f"{row['teacher_forced_top1']:>8.3f} {row['greedy_prefix']:>13.3f} "
                       f"{row['max_abs_logit_error']:>8.3f}" if "teacher_forced_top1" in row
                       else f"{'-':>8} {'-':>13} {'-':>8}")
                print(f"{q:<8} {row['weight_bytes'] / 1e6:>7.1f} "
                      f"{row['kv_tokens_in_saved_bytes']:>10} {fid} {cells}")
    print("\nMB: the model's tensors; KV tokens: what the bytes saved hold as KV pages; TF top1: teacher-forced "
          "top-1 agreement with full width; greedy prefix: share of tokens before the first difference; "
          "step columns: ms and the ratio to full width")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "opt-125m"], choices=sorted(MODELS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="full width (always run: the reference), quantized at load, or a checkpoint written quantized")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    add_cache_dir(p)
    args = p.parse_args()
    args.variants = ["full", *[v for v in args.variants if v != "full"]]
    torch.manual_seed(0)
    results = [run_model(m, args) for m in args.models]
    print_table(results)
    if args.json:
        header = stamp(threads=args.threads, dtype=args.dtypes, model=args.models, simulated=False,
                       batches=args.batches, max_tokens=args.max_tokens, prompts=len(PROMPTS))
        print("written:", write_json(args.json, {"results": results}, header))


if __name__ == "__main__":
    main()

"""What the INT8 cache kinds cost in accuracy and buy in capacity, against the KV cache in the same dtype.

    python benchmarks/int8_accuracy.py [--models smollm2 opt-125m llama-mha] [--dtypes bfloat16 float32]
                                       [--max-tokens 64] [--json docs/benchmarks/int8_accuracy.json]
    python benchmarks/int8_accuracy.py --table      # print the table of the JSON

Every kind runs the same held-out prompts (``PROMPTS``) as one batch through the model runner: KV
greedy as the reference, each int8 kind teacher-forced on its tokens (logit error, top-1 agreement)
and greedy on its own (agreement with KV's tokens); with both dtypes bf16 KV against fp32 KV is the
noise floor. Capacity: tokens per GiB by kind. A run replaces the models it measures in the JSON and
keeps the others. Setup and results: docs/benchmarks.md ("Cache kinds").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.bench.engine_args import Default, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json as write_stamped
from apt_serve_ray.models.checkpoints import SHAPES
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.output import ScheduledChunk
# A Llama with OPT-125m's shape and multi-head attention (where hidden pages save memory); benchmark-only.
SHAPES.setdefault("llama-mha-125m", ("llama", 768, 12, 12, 12, 3072))
MODELS = {"smollm2": None, "opt-125m": "opt-125m", "llama-mha": "llama-mha-125m"}
KINDS = (CacheKind.KV, CacheKind.HIDDEN, CacheKind.KV_INT8, CacheKind.HIDDEN_INT8)
MEASURED = (CacheKind.KV_INT8, CacheKind.HIDDEN_INT8)  # hidden is exact (tests/cache/test_hybrid_cache.py)

PROMPTS = [
    "Explain in two sentences why the sky looks blue during the day.",
    "Write a short poem about a lighthouse keeper who has never seen the sea in a storm.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number iteratively.\"\"\"\n",
    "The capital of Australia is",
    "Translate to French: 'The train leaves at seven and arrives before noon.'",
    "List three differences between a process and a thread in an operating system.",
    "Once upon a time, in a village at the foot of a glacier, there lived a baker who",
    "Q: If a rectangle is 7 cm wide and 12 cm long, what is its area?\nA:",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Give me a recipe for a simple tomato soup with ingredients and steps.",
    "The mitochondria is often called the powerhouse of the cell because",
    "Write a polite email declining a meeting invitation for next Tuesday.",
    "In 1969, the Apollo 11 mission",
    "Describe the rules of chess for the knight and the bishop.",
    "A haiku about autumn rain:\n",
    "Compare Python lists and tuples, with an example of when to use each.",
    "Dear diary, today the robot in the kitchen finally learned how to",
    "Why do cats purr? Give the scientific explanations that are currently discussed.",
]


def _batch_logits(engine, requests, num_tokens) -> torch.Tensor:
    """One forward of ``requests`` (``num_tokens`` each from their computed position); the logits of
    each request's last row [R, vocab]."""
    chunks = [ScheduledChunk(r, n) for r, n in zip(requests, num_tokens)]
    logits = engine.runner.logits_for_all_rows(chunks)
    ends = torch.tensor(num_tokens).cumsum(0) - 1
    for r, n in zip(requests, num_tokens):
        r.num_computed_tokens += n
    return logits[ends]


def run_kind(engine, prompts: list[list[int]], kind: CacheKind, max_tokens: int,
             forced: list[list[int]] | None = None) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy (``forced`` None) or teacher-forced on ``forced`` tokens: every prompt in ``kind`` pages,
    all in one batch per step. Returns each prompt's tokens and logits [P, max_tokens, vocab]."""
    requests = [engine.make_request(list(p), SamplingParams(max_tokens=max_tokens)) for p in prompts]
    steps = []
    try:
        for r in requests:
            if not engine.cache.allocate(r, r.num_tokens + max_tokens, kind):
                raise SystemExit("the cache is too small for the prompts: raise --num-pages")
        num = [r.num_tokens for r in requests]
        for step in range(max_tokens):
            logits = _batch_logits(engine, requests, num)
            steps.append(logits)
            for i, r in enumerate(requests):
                r.all_token_ids.append(forced[i][step] if forced else int(logits[i].argmax()))
            num = [1] * len(requests)
    finally:
        for r in requests:
            engine.cache.free(r)
    engine.cache.pool.check_integrity()
    tokens = [r.all_token_ids[len(p):] for r, p in zip(requests, prompts)]
    return tokens, torch.stack(steps, dim=1)


def compare(ref_tokens, ref_logits, tf_logits, free_tokens) -> dict:
    """A kind's teacher-forced logits and free-running tokens against the reference run's."""
    err = (tf_logits - ref_logits).abs()
    out = {
        "max_abs_logit_error": err.max().item(),
        "mean_abs_logit_error": err.mean().item(),
        "teacher_forced_top1": (tf_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
    }
    if free_tokens is not None:
        n = len(ref_tokens[0])
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(ref_tokens, free_tokens)]
        out.update(
            greedy_all_equal=sum(p == n for p in prefix) / len(prefix),
            greedy_prefix=sum(prefix) / (n * len(prefix)),
            greedy_positional=sum(a == b for x, y in zip(ref_tokens, free_tokens) for a, b in zip(x, y))
            / (n * len(prefix)),
        )
    return out


def capacity(layout) -> dict:
    """Tokens per GiB of cache by kind, in bf16 and fp32 pages (scales counted in the page)."""
    out = {}
    for name, nbytes in (("bfloat16", 2), ("float32", 4)):
        lay = dataclasses.replace(layout, dtype_bytes=nbytes)
        per_gib = {k.value: lay.tokens_per_page(k) * (2**30 // lay.bytes_per_page) for k in KINDS}
        out[name] = {k: {"tokens_per_page": lay.tokens_per_page(CacheKind(k)), "tokens_per_gib": v,
                         "vs_kv": v / per_gib["kv"]} for k, v in per_gib.items()}
    return out


def model_path(name: str, cache_dir: Path) -> str:
    shape = MODELS[name]
    if shape is None:
        return "smollm2-135m-instruct"
    return random_checkpoint(shape, cache_dir)


def run_model(name: str, args, prompts_text) -> dict:
    result = {"model": name, "num_prompts": len(prompts_text), "max_tokens": args.max_tokens, "dtypes": {}}
    fp32_kv = None  # (tokens, logits) of the fp32 KV run, for the bf16 noise floor
    for dtype in sorted(args.dtypes, key=lambda d: d != "float32"):
        t0 = time.perf_counter()
        llm = LLM(model_path(name, args.cache_dir), dtype=dtype, num_pages=args.num_pages, force_hidden=True,
                  cache_kinds=("hidden", "kv-int8", "hidden-int8"), max_num_batched_tokens=4096, max_num_seqs=64,
                  num_threads=args.num_threads, attention_backend=args.backend, calibrate_rho=False)
        engine = llm.llm_engine
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in prompts_text]
        result["capacity"] = capacity(engine.layout)
        kv_tokens, kv_logits = run_kind(engine, prompts, CacheKind.KV, args.max_tokens)
        rows = {"kv": {"logit_std": kv_logits.std(-1).mean().item()}}
        for kind in MEASURED:
            _, tf = run_kind(engine, prompts, kind, args.max_tokens, forced=kv_tokens)
            free, _ = run_kind(engine, prompts, kind, args.max_tokens)
            rows[kind.value] = compare(kv_tokens, kv_logits, tf, free)
        if dtype == "float32":
            fp32_kv = (kv_tokens, kv_logits)
        elif fp32_kv is not None:
            _, tf = run_kind(engine, prompts, CacheKind.KV, args.max_tokens, forced=fp32_kv[0])
            rows["kv vs fp32 kv"] = compare(fp32_kv[0], fp32_kv[1], tf, kv_tokens)
        result["dtypes"][dtype] = rows
        print(f"{name} {dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llm, engine
    return result


def print_table(results) -> None:
    print("\nAccuracy vs the KV cache in the same dtype (prompts x generated tokens per model)")
    head = (f"{'model':<10} {'run':>6} {'dtype':<9} {'kind':<14} {'TF top1':>8} {'greedy=':>8} {'prefix':>7} {'pos=':>6} "
            f"{'max err':>8} {'mean err':>9} {'logit std':>9}")
    print(head)
    print("-" * len(head))
    for res in results:
        for dtype, rows in res["dtypes"].items():
            std = rows["kv"]["logit_std"]
            for kind, row in rows.items():
                if kind == "kv":
                    continue
                run = f"{res['num_prompts']}x{res['max_tokens']}"
                print(f"{res['model']:<10} {run:>6} {dtype:<9} {kind:<14} {row['teacher_forced_top1']:>8.3f} "
                      f"{row['greedy_all_equal']:>8.2f} {row['greedy_prefix']:>7.3f} {row['greedy_positional']:>6.3f} "
                      f"{row['max_abs_logit_error']:>8.4f} {row['mean_abs_logit_error']:>9.5f} {std:>9.3f}")
    print("TF top1: teacher-forced top-1 agreement; greedy=: prompts whose tokens all equal KV's; prefix: mean share "
          "before the first difference; pos=: equal tokens by position; errors: |logit - KV logit|, teacher-forced")
    print("\nCapacity: tokens per page and per GiB of cache (scales included), and vs KV in the same dtype")
    head = f"{'model':<10} {'dtype':<9} " + " ".join(f"{k.value:>22}" for k in KINDS)
    print(head)
    print("-" * len(head))
    for res in results:
        for dtype, cap in res["capacity"].items():
            cells = " ".join(f"{c['tokens_per_page']:>4} {c['tokens_per_gib']:>9} {c['vs_kv']:>5.2f}x"
                             for c in (cap[k.value] for k in KINDS))
            print(f"{res['model']:<10} {dtype:<9} {cells}")


def load_results(path: Path) -> list[dict]:
    old = json.loads(path.read_text())
    for r in old["results"]:  # files written before results carried their run's size
        r.setdefault("num_prompts", len(old.get("prompts", PROMPTS)))
        r.setdefault("max_tokens", old.get("max_tokens"))
    return old["results"]


def write_json(path: Path, header: dict, results: list[dict]) -> None:
    """Write ``results`` to ``path``, keeping the models of an earlier file that this run did not
    measure (each model's result says its prompts and tokens)."""
    ran = {r["model"] for r in results}
    kept = [r for r in load_results(path) if r["model"] not in ran] if path.exists() else []
    order = list(MODELS)
    merged = sorted(kept + results, key=lambda r: order.index(r["model"]))
    write_stamped(path, {"results": merged}, header)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    add_engine_args(ap, "num_pages", "num_threads",
                    num_pages=Default(600, "the 20 prompts and their tokens in every kind at once"))
    ap.add_argument("--backend", default="torch", help="attention backend: the reference (torch) defines the kinds; "
                    "the fast backends are tested against it")
    add_cache_dir(ap)
    ap.add_argument("--json", type=Path, default=Path("docs/benchmarks/int8_accuracy.json"))
    ap.add_argument("--table", action="store_true", help="print the table of --json and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(load_results(args.json))
        return 0
    prompts = PROMPTS[: args.num_prompts]
    threads = args.num_threads or torch.get_num_threads()
    header = stamp(threads=threads, dtype=args.dtypes, model=args.models, simulated=False)
    machine = header["machine"]
    cpu = {"name": machine["cpu"], "avx512_bf16": "avx512_bf16" in machine["cpu_flags"], "threads": threads}
    print(f"CPU: {cpu['name']} (avx512_bf16: {cpu['avx512_bf16']}), torch threads {cpu['threads']}", flush=True)
    results = []
    for name in args.models:
        results.append(run_model(name, args, prompts))
        if args.json:  # after every model: a long run that stops early keeps what it measured
            write_json(args.json, {**header, "cpu": cpu, "backend": args.backend, "prompts": PROMPTS}, results)
    print_table(results)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

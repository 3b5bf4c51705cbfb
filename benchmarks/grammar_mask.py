"""Per-token cost of a structured-output mask on this CPU: xgrammar vs llguidance (issue 29).

For a JSON schema (and any JSON object), through our ``StructuredOutputs`` with each library: compile
the grammar for the default model's tokenizer, then per generated token fill the allowed-token bitmask,
apply it to the logits and advance the matcher with the token picked (the likeliest allowed one under
random logits, so every sequence stays valid). Timed: compile, and mask + advance per token, at batch 1
and 32 (one matcher per row, filled one after the other on one thread). Prints a table, writes JSON.

    python benchmarks/grammar_mask.py --json docs/benchmarks/structured/grammar_mask.json
"""

from __future__ import annotations

import argparse
import time

import torch

from apt_serve_ray.bench.engine_args import ONE_THREAD, add_engine_args
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.workloads import JSON_SCHEMA as SCHEMA
from apt_serve_ray.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from apt_serve_ray.sampling.structured import GRAMMAR_BACKENDS, StructuredOutput, StructuredOutputs


def run(backend: str, tokenizer, vocab: int, spec: StructuredOutput, batch: int, max_tokens: int,
        seed: int) -> dict:
    """Our whole path (``StructuredOutputs``): compile (a fresh cache), then per step mask a batch of
    logits and advance every live row's matcher with the likeliest allowed token."""
    so = StructuredOutputs(tokenizer, vocab, backend)
    t0 = time.perf_counter()
    so.compile(spec)
    compile_s = time.perf_counter() - t0
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        so.add(rid, spec)
    gen = torch.Generator().manual_seed(seed)
    alive = list(ids)
    steps, tokens, spent = 0, 0, 0.0
    while alive and steps < max_tokens:
        logits = torch.randn(len(alive), vocab, generator=gen)
        t0 = time.perf_counter()
        so.mask(logits, alive)
        picks = logits.argmax(-1).tolist()
        done = [so.accept(rid, tok) for rid, tok in zip(alive, picks)]
        spent += time.perf_counter() - t0
        tokens += len(alive)
        alive = [rid for rid, d in zip(alive, done) if not d]
        steps += 1
    return {"library": backend, "grammar": "json_schema" if spec.json is not None else "json_object", "batch": batch,
            "compile_ms": compile_s * 1e3, "steps": steps, "ms_per_step": spent / steps * 1e3,
            "us_per_row_token": spent / max(1, tokens) * 1e6}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    add_engine_args(p, "num_threads", num_threads=ONE_THREAD)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    vocab = len(tokenizer)
    rows = []
    for backend in GRAMMAR_BACKENDS:
        for spec in (StructuredOutput(json=SCHEMA), StructuredOutput(json_object=True)):
            for batch in args.batches:
                run(backend, tokenizer, vocab, spec, batch, 4, seed=0)  # warm-up (imports, allocations)
                rows.append(run(backend, tokenizer, vocab, spec, batch, args.max_tokens, seed=1))
    print(f"{'library':<11} {'grammar':<12} {'batch':>5} {'compile ms':>10} {'ms/step':>8} {'us/row-token':>12}")
    for r in rows:
        print(f"{r['library']:<11} {r['grammar']:<12} {r['batch']:>5} {r['compile_ms']:>10.1f} "
              f"{r['ms_per_step']:>8.3f} {r['us_per_row_token']:>12.1f}")
    if args.json:
        header = stamp(threads=args.num_threads, dtype="n/a", model=DEFAULT_MODEL, simulated=False)
        write_json(args.json, {"vocab": vocab, "schema": SCHEMA, "rows": rows}, header)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

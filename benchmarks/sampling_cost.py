"""What the sampler's extra work costs a token on this CPU (issue 29): logit bias, presence / frequency
and repetition penalties, and a structured-output mask, each against plain greedy sampling.

    python benchmarks/sampling_cost.py [--batches 1 32] [--json docs/benchmarks/structured/sampling_cost.json]
    python benchmarks/sampling_cost.py --grammars [--json docs/benchmarks/structured/grammar_mask.json]

The engine's own ``Sampler.sample`` on logits of the default model's vocabulary for a batch of
requests with 400 prompt and 200 generated tokens, every row with one setting (``SETTINGS``), fastest
of ``--repeats``, interleaved; microseconds a row-token over plain's. ``--grammars``: the grammar
libraries side by side instead (xgrammar, llguidance) through ``StructuredOutputs``: compile, then
per token mask the logits and advance every row's matcher with the likeliest allowed token.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import ONE_THREAD, add_engine_args
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.workloads import JSON_SCHEMA as SCHEMA
from apt_serve_ray.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from apt_serve_ray.request import Request
from apt_serve_ray.sampling.sampler import Sampler
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.sampling.structured import GRAMMAR_BACKENDS, StructuredOutput, StructuredOutputs

SETTINGS = {
    "plain": {},
    "logit_bias": {"logit_bias": {i * 97: 2.0 for i in range(10)}},
    "presence+frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "repetition": {"repetition_penalty": 1.2},
    "all penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "json_schema": {"structured_output": StructuredOutput(json=SCHEMA)},
}


def requests_for(setting: str, batch: int, vocab: int, gen: torch.Generator) -> list[Request]:
    out = []
    for i in range(batch):
        prompt = torch.randint(10, vocab, (400,), generator=gen).tolist()
        r = Request(f"{setting}-{i}", prompt, SamplingParams(temperature=0, max_tokens=1000, **SETTINGS[setting]),
                    max_total_tokens=4096, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
        r.output_token_ids = torch.randint(10, vocab, (200,), generator=gen).tolist()
        r.all_token_ids = prompt + r.output_token_ids
        out.append(r)
    return out


def grammar_run(backend: str, tokenizer, vocab: int, spec: StructuredOutput, batch: int, max_tokens: int,
                seed: int) -> dict:
    """``--grammars``: compile ``spec`` (a fresh cache), then per step mask a batch of logits and
    advance every live row's matcher with the likeliest allowed token."""
    so = StructuredOutputs(tokenizer, vocab, backend)
    t0 = time.perf_counter()
    so.compile(spec)
    compile_s = time.perf_counter() - t0
    alive = [f"r{i}" for i in range(batch)]
    for rid in alive:
        so.add(rid, spec)
    gen = torch.Generator().manual_seed(seed)
    steps, tokens, spent = 0, 0, 0.0
    while alive and steps < max_tokens:
        logits = torch.randn(len(alive), vocab, generator=gen)
        t0 = time.perf_counter()
        so.mask(logits, alive)
        done = [so.accept(rid, tok) for rid, tok in zip(alive, logits.argmax(-1).tolist())]
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
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--grammars", action="store_true", help="xgrammar vs llguidance: compile, mask + advance a token")
    p.add_argument("--max-tokens", type=int, default=64, help="--grammars: tokens generated per row")
    add_engine_args(p, "num_threads", num_threads=ONE_THREAD)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    vocab = len(tokenizer)
    header = stamp(threads=args.num_threads, dtype="float32", model=DEFAULT_MODEL, simulated=False, vocab=vocab)
    if args.grammars:
        rows = []
        for backend in GRAMMAR_BACKENDS:
            for spec in (StructuredOutput(json=SCHEMA), StructuredOutput(json_object=True)):
                for batch in args.batches:
                    grammar_run(backend, tokenizer, vocab, spec, batch, 4, seed=0)  # warm-up (imports, allocations)
                    rows.append(grammar_run(backend, tokenizer, vocab, spec, batch, args.max_tokens, seed=1))
                    r = rows[-1]
                    print(f"{backend:<11} {r['grammar']:<12} batch {batch:3d}  compile {r['compile_ms']:8.1f} ms  "
                          f"{r['ms_per_step']:8.3f} ms a step  {r['us_per_row_token']:8.1f} us a row-token")
        if args.json:
            write_json(args.json, {"vocab": vocab, "schema": SCHEMA, "rows": rows}, header)
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        sampler = Sampler(0)
        sampler.structured = StructuredOutputs(tokenizer, vocab, "llguidance")
        cases = {s: requests_for(s, batch, vocab, gen) for s in SETTINGS}
        for r in cases["json_schema"]:
            sampler.structured.add(r.request_id, r.sampling_params.structured_output)
        best = dict.fromkeys(SETTINGS, float("inf"))
        for _ in range(args.repeats):
            for setting, reqs in cases.items():
                logits = torch.randn(batch, vocab, generator=gen)
                t0 = time.perf_counter()
                picks = sampler.sample(logits, reqs)
                best[setting] = min(best[setting], time.perf_counter() - t0)
                if setting == "json_schema" and any(t.grammar_done for t in picks):  # start the grammar over
                    for r in reqs:
                        sampler.structured.forget(r.request_id)
                        sampler.structured.add(r.request_id, r.sampling_params.structured_output)
        for setting in SETTINGS:
            extra = (best[setting] - best["plain"]) / batch * 1e6
            rows.append({"setting": setting, "batch": batch, "step_ms": best[setting] * 1e3,
                         "extra_us_per_row_token": extra})
            print(f"batch {batch:3d}  {setting:20s} {best[setting] * 1e3:8.3f} ms a step  "
                  f"{extra:+9.1f} us a row-token over plain")
    if args.json:
        write_json(args.json, {"rows": rows}, header)


if __name__ == "__main__":
    main()

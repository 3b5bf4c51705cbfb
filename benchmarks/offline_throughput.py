"""Offline throughput: our engine vs transformers ``generate`` (static batching), same process.

    python benchmarks/offline_throughput.py [--threads 1 2] [--quick] [--json out.json]

Random prompts on a random-weight checkpoint (issue 2: 64 requests of 256 + 64 tokens, bf16); our
engine driven step by step with each step split into scheduler / prepare / forward / logits / sampler
/ postprocess (``bench/steps.py``), transformers in static batches of ``--hf-batch-size`` and once
prefill-only (the speed-up ceiling at equal prefill speed). ``overhead_share``: the share of step time
outside the forward and lm-head. Results: docs/benchmarks.md ("Engine vs transformers").
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.bench.engine_args import Default, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import PARTS, StepTimers, breakdown


# Workload ----------------------------------------------------------------------------------------
def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the first ids: SmolLM2's tokenizer keeps its special tokens there.
    return torch.randint(100, vocab, (num, length), generator=g).tolist()


# Our engine --------------------------------------------------------------------------------------
def build_engine(path: str, args, num_pages: int) -> tuple[LLM, StepTimers]:
    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_pages=num_pages, cache_ratio=0.0)
    return llm, StepTimers.on(llm.llm_engine.runner)


def run_engine(llm: LLM, timers: StepTimers, prompts, output_len: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    gc.collect()
    timers.take()
    steps: list[dict] = []
    num_out = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - ts
        stats = engine.last_step
        if stats is None:
            continue
        rec = {"schedule_s": stats.schedule_s, "execute_s": stats.execute_s, "total_s": stats.total_s,
               "num_tokens": stats.num_tokens, "num_seqs": stats.num_seqs, "wall_s": wall, **timers.take()}
        steps.append(rec)
        num_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if num_out != len(prompts) * output_len:
        raise RuntimeError(f"engine produced {num_out} output tokens, expected {len(prompts) * output_len}")
    return {"elapsed_s": elapsed, "cpu_s": cpu, "output_tokens": num_out, "tok_s": num_out / elapsed,
            "tok_per_cpu_s": num_out / cpu, "breakdown": breakdown(steps), "num_steps": len(steps)}


# transformers ------------------------------------------------------------------------------------
def load_hf(path: str, dtype: str = "bfloat16"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


@torch.inference_mode()
def run_hf(model, tok, prompts, output_len: int, batch_size: int) -> dict:
    gc.collect()
    num_out = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch_size):
        batch = tok.pad({"input_ids": prompts[i : i + batch_size]}, padding=True, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        num_out += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"elapsed_s": elapsed, "cpu_s": cpu, "output_tokens": num_out, "tok_s": num_out / elapsed,
            "tok_per_cpu_s": num_out / cpu, "batch_size": batch_size}


def contention_probe(threads: int) -> float:
    """ms per small matmul ([8, 768] x [768, 3072] bf16) at ``threads``: on an idle machine ~0.2-0.3 ms;
    tens of ms mean other processes hold the cores and the thread pool's barriers stall."""
    torch.set_num_threads(threads)
    a, w = torch.randn(8, 768, dtype=torch.bfloat16), torch.randn(3072, 768, dtype=torch.bfloat16)
    for _ in range(5):
        torch.nn.functional.linear(a, w)
    t = time.perf_counter()
    for _ in range(50):
        torch.nn.functional.linear(a, w)
    return (time.perf_counter() - t) / 50 * 1e3


# Report ------------------------------------------------------------------------------------------
def print_table(results: list[dict]) -> None:
    print()
    print(f"{'threads':>7} {'engine tok/s':>12} {'HF tok/s':>9} {'ratio':>6} {'cpu ratio':>9} {'ceiling':>7} "
          f"{'eng prefill s':>13} {'HF prefill s':>12} {'overhead':>8} {'ovh decode':>10} {'decode step ms':>14} "
          f"{'ovh/step ms':>11}")
    for r in results:
        b = r["engine"]["breakdown"]
        dec = b.get("decode", b["all"])
        cpu_ratio = r["engine"]["tok_per_cpu_s"] / r["hf"].get("tok_per_cpu_s", float("nan"))
        print(f"{r['threads']:>7} {r['engine']['tok_s']:>12.1f} {r['hf']['tok_s']:>9.1f} {r['speedup']:>5.2f}x "
              f"{cpu_ratio:>8.2f}x {r['hf'].get('speedup_ceiling', float('nan')):>6.2f}x "
              f"{r['engine']['prefill_s']:>13.1f} {r['hf'].get('prefill_s', float('nan')):>12.1f} "
              f"{b['all']['overhead_share']:>8.1%} {dec['overhead_share']:>10.1%} {dec['median_step_ms']:>14.1f} "
              f"{dec['median_overhead_ms']:>11.2f}")
    print("cpu ratio = the same ratio in output tokens per CPU-second of this process (steadier than wall time\n"
          "when other processes share the cores; with 2 threads it also counts spin-waiting threads);")
    print("ceiling = HF total / HF prefill-only: the most any engine can gain while its prefill is as fast as HF's;"
          "\noverhead = share of step time outside model.forward + lm-head (ovh decode: decode-only steps)")
    print()
    print("engine step time by part (share of summed step time)")
    print(f"{'threads':>7} {'steps':>9} " + " ".join(f"{k[:-2]:>13}" for k in PARTS))
    for r in results:
        for group in ("all", "prefill", "decode"):
            g = r["engine"]["breakdown"].get(group)
            if g:
                print(f"{r['threads']:>7} {group:>9} " + " ".join(f"{g['share'][k]:>13.1%}" for k in PARTS))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cache_dir(ap)
    ap.add_argument("--shape", default="opt-125m", help="random-weight checkpoint shape (apt_serve_ray.models.checkpoints.SHAPES)")
    add_engine_args(ap, "dtype", "num_pages", "max_num_seqs", "max_num_batched_tokens",
                    dtype=Default("bfloat16", "transformers runs the same dtype; fp32 on a CPU without native bf16",
                                  ("bfloat16", "float32")),
                    num_pages=Default(None, "enough that nobody is preempted: this measures throughput "
                                            "(378 = the vLLM comparison's 6,048 tokens)"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads; each value is measured")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="32 requests (half the work)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-hf-prefill", action="store_true", help="skip the HF prefill-only run (speed-up ceiling)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 32)

    path = random_checkpoint(args.shape, args.cache_dir)
    # Enough pages that nobody is ever preempted: this measures throughput, not memory pressure.
    block = 16
    num_pages = args.num_pages or args.num_requests * -(-(args.prompt_len + args.output_len) // block) + 16
    llm, timers = build_engine(path, args, num_pages)
    vocab = llm.llm_engine.vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, args.seed)
    warm = make_prompts(4, 32, vocab, args.seed + 1)
    hf = None if args.skip_hf else load_hf(path, args.dtype)

    results = []
    for threads in args.threads:
        probe = contention_probe(threads)
        load = os.getloadavg()[0]
        print(f"[threads={threads}] contention probe {probe:.2f} ms/matmul, load average {load:.2f}", flush=True)
        run_engine(llm, timers, warm, 4)  # warm-up: allocator, thread pool, kernels
        eng = run_engine(llm, timers, prompts, args.output_len)
        print(f"[threads={threads}] engine: {eng['output_tokens']} tokens in {eng['elapsed_s']:.1f} s "
              f"= {eng['tok_s']:.1f} tok/s over {eng['num_steps']} steps", flush=True)
        if hf is not None:
            run_hf(*hf, warm, 4, args.hf_batch_size)
            hfr = run_hf(*hf, prompts, args.output_len, args.hf_batch_size)
            print(f"[threads={threads}] transformers: {hfr['output_tokens']} tokens in {hfr['elapsed_s']:.1f} s "
                  f"= {hfr['tok_s']:.1f} tok/s (batch {args.hf_batch_size})", flush=True)
            if not args.skip_hf_prefill:
                # The same batches with one output token: HF's prefill cost. Any engine whose prefill is
                # no faster than HF's (both are the same matmuls) is at most hf_elapsed / hf_prefill faster.
                hfr["prefill_s"] = run_hf(*hf, prompts, 1, args.hf_batch_size)["elapsed_s"]
                hfr["speedup_ceiling"] = hfr["elapsed_s"] / hfr["prefill_s"]
                print(f"[threads={threads}] transformers prefill only: {hfr['prefill_s']:.1f} s "
                      f"(speed-up ceiling at equal prefill speed: {hfr['speedup_ceiling']:.2f}x)", flush=True)
        else:
            hfr = {"tok_s": float("nan"), "elapsed_s": float("nan"), "output_tokens": 0, "batch_size": 0,
                   "tok_per_cpu_s": float("nan")}
        eng["prefill_s"] = eng["breakdown"].get("prefill", {}).get("seconds", {}).get("total_s", 0.0)
        results.append({"threads": threads, "engine": eng, "hf": hfr, "speedup": eng["tok_s"] / hfr["tok_s"],
                        "contention_probe_ms": probe, "load_average": load})
    print_table(results)
    llm.llm_engine.cache.pool.check_integrity()

    if args.json is not None:
        head = results[-1] if len(results) == 1 else max(results, key=lambda r: r["threads"])
        doc = {
            "engine_tok_s": head["engine"]["tok_s"], "hf_tok_s": head["hf"]["tok_s"],
            "overhead_share": head["engine"]["breakdown"]["all"]["overhead_share"],
            "threads": head["threads"],
            "by_threads_summary": {str(r["threads"]): {
                "engine_tok_s": r["engine"]["tok_s"], "hf_tok_s": r["hf"]["tok_s"], "speedup": r["speedup"],
                "engine_tok_per_cpu_s": r["engine"]["tok_per_cpu_s"], "hf_tok_per_cpu_s": r["hf"].get("tok_per_cpu_s"),
                "overhead_share": r["engine"]["breakdown"]["all"]["overhead_share"],
                "decode_overhead_share": r["engine"]["breakdown"].get("decode", {}).get("overhead_share"),
                "hf_speedup_ceiling": r["hf"].get("speedup_ceiling"),
                "contention_probe_ms": r["contention_probe_ms"]} for r in results},
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "dtype": args.dtype, "shape": args.shape,
                         "hf_batch_size": args.hf_batch_size, "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens},
            "by_threads": results,
            "torch": torch.__version__, "cpu_count": os.cpu_count(),
        }
        header = stamp(threads=args.threads, dtype=args.dtype, model=f"{args.shape} (random weights)", simulated=False)
        doc.update(cpu=header["machine"]["cpu"], native_bf16=header["machine"]["native_bf16"])
        write_json(args.json, doc, header, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

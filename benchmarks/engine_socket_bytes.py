"""What one step sends across the engine socket (issue 28): ``EngineCore``'s pickled step message at
``--requests`` running requests of ``--context``-token contexts, outputs as deltas (``DELTA``) against
whole outputs (``CUMULATIVE``), on the same engine, decode steps only; bytes per step (mean, largest)
and the time to pickle it on the step loop. The model's size changes nothing sent (``--shape``).

    .venv/bin/python benchmarks/engine_socket_bytes.py --json docs/benchmarks/engine/socket_bytes.json
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json


def measure(engine, kind, requests: int, context: int, decode_steps: int, logprobs: int | None) -> dict:
    from apt_serve_ray import SamplingParams

    prompt_len = context - decode_steps
    params = SamplingParams(max_tokens=decode_steps, ignore_eos=True, temperature=0, output_kind=kind,
                            logprobs=logprobs)
    for i in range(requests):  # distinct first tokens: no prefix shared between them
        engine.add_request([5 + i] + [7 + (j % 500) for j in range(prompt_len - 1)], params, f"{kind.value}-{i}")
    sizes, pickle_s = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step = engine.last_step
        if step is None or step.num_prefill_tokens:
            continue  # prefill steps (and their first tokens) are not what grows
        msg = ("step", outputs, step.cache, step.total_s, None)
        t0 = time.perf_counter()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        pickle_s.append(time.perf_counter() - t0)
        sizes.append(len(data))
    return {"kind": kind.value, "decode_steps": len(sizes), "bytes_per_step_mean": statistics.fmean(sizes),
            "bytes_max_step": max(sizes),
            "bytes_total": sum(sizes), "pickle_ms_per_step_mean": 1000 * statistics.fmean(pickle_s)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="opt-tiny")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--context", type=int, default=2000, help="prompt + generated tokens of each request")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (None: off)")
    add_cache_dir(p)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    from apt_serve_ray import EngineConfig, LLMEngine, RequestOutputKind
    ckpt = random_checkpoint(a.shape, a.cache_dir, dtype="float32")
    pages = a.requests * (-(-a.context // 16) + 1) + 16
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", num_pages=pages, max_num_seqs=a.requests,
                                    max_model_len=a.context + 16, max_num_batched_tokens=4096,
                                    calibrate_rho=False, swap_space=0, enable_prefix_caching=False))
    rows = [measure(engine, kind, a.requests, a.context, a.decode_steps, a.logprobs)
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)]
    before, after = rows
    print(f"{a.requests} running requests of {a.context}-token contexts, {before['decode_steps']} decode steps"
          f" (logprobs: {a.logprobs})")
    print(f"{'outputs':<12}{'bytes/step':>12}{'largest':>12}{'pickle ms/step':>16}")
    for r in rows:
        print(f"{r['kind']:<12}{r['bytes_per_step_mean']:>12,.0f}{r['bytes_max_step']:>12,}"
              f"{r['pickle_ms_per_step_mean']:>16.3f}")
    ratio = before["bytes_per_step_mean"] / after["bytes_per_step_mean"]
    print(f"cumulative / delta: {ratio:.1f}x the bytes, "
          f"{before['pickle_ms_per_step_mean'] / after['pickle_ms_per_step_mean']:.1f}x the pickling time")
    if a.json:
        header = stamp(threads=None, dtype="float32", model=f"{a.shape} (random weights)", simulated=False,
                       shape=a.shape, requests=a.requests, context=a.context, decode_steps=a.decode_steps,
                       logprobs=a.logprobs)
        write_json(a.json, {"results": rows, "bytes_ratio": ratio}, header)


if __name__ == "__main__":
    main()

"""One engine step, timed whole, backend against backend: where a decode step's time goes.

Times ``ModelRunner.execute`` (the whole step the engine runs) on decode batches of B requests of C
tokens each, on a random-weight checkpoint (``--shape``), for every attention backend x cache kind in
``--configs``, dtype and thread count, interleaved per batch shape (fastest of ``--repeats``).
``--profile``: a torch.profiler breakdown by operator group; ``--flop-model``: the hidden kinds' extra
time per context token over KV against a FLOP model of the K/V projection, and the calibrated rho
(what ``hidden_cache_cost.py`` measured, issue 3). What each option means and the results:
docs/benchmarks.md; ``gpu_check.sh`` runs it on CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, decode_batch, group_ops, op_table, time_step
from apt_serve_ray.request import CacheKind
from apt_serve_ray.worker.calibration import calibrate_rho

# name: (attention_backend, kind, cache_proj_optimize); "fast" is the device's own backend (cpu / triton).
CONFIGS = {
    "torch kv": ("torch", CacheKind.KV, False),
    "fast kv": ("fast", CacheKind.KV, True),
    "torch hidden": ("torch", CacheKind.HIDDEN, False),
    "fast hidden unfused": ("fast", CacheKind.HIDDEN, False),
    "fast hidden fused": ("fast", CacheKind.HIDDEN, True),
    "torch kv-int8": ("torch", CacheKind.KV_INT8, False),
    "fast kv-int8": ("fast", CacheKind.KV_INT8, True),
    "torch hidden-int8": ("torch", CacheKind.HIDDEN_INT8, False),
    "fast hidden-int8 fused": ("fast", CacheKind.HIDDEN_INT8, True),
}
# int8 kind -> its base kind: the ratio printed per batch shape (the int8 kernels' cost over the exact kind's).
INT8_BASES = {"fast kv-int8": "fast kv", "fast hidden-int8 fused": "fast hidden fused",
              "torch kv-int8": "torch kv", "torch hidden-int8": "torch hidden"}
HIDDEN_BASES = {"torch hidden": "torch kv", "fast hidden unfused": "fast kv"}  # the paths that project K/V


def projection_gflops(rows: int, hidden: int, dtype: str, device: str, repeats: int) -> float:
    """Measured rate of the K/V projection a hidden request redoes per context token and step:
    [rows, hidden] x [hidden, 2 hidden] (rows capped at 8192, where the rate has long saturated)."""
    a = torch.randn(min(rows, 8192), hidden, dtype=getattr(torch, dtype), device=device)
    w = torch.randn(2 * hidden, hidden, dtype=a.dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    F.linear(a, w)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        F.linear(a, w)
        sync()
        best = min(best, time.perf_counter() - t)
    return 4 * a.shape[0] * hidden * hidden / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1, 8, 32 at 400 tokens only")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[400, 1000])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="thread: CPU time of the calling thread (with --threads 1 only)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-config", default="fast kv")
    p.add_argument("--profile-batch", type=int, default=8)
    p.add_argument("--profile-context", type=int, default=400)
    p.add_argument("--flop-model", action="store_true",
                   help="hidden kinds: extra us per context token over KV against a FLOP model; calibrated rho")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="opt-125m", help="checkpoint shape (apt_serve_ray.models.checkpoints.SHAPES), "
                   "e.g. opt-13b-2l: two layers of OPT-13B (hidden 5120, 40 heads)")
    add_cache_dir(p)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts = [1, 8, 32], [400]
    if args.clock == "thread" and (args.threads != [1] or args.device != "cpu"):
        p.error("--clock thread times one CPU thread: use it with --threads 1 on the CPU")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    path = random_checkpoint(args.shape, args.cache_dir)
    num_pages = max(args.batches) * -(-max(args.contexts) // 16) + 8  # every request on its own KV pages
    rows, profiles, rhos = [], {}, {}
    header = stamp(threads=args.threads, dtype=args.dtypes, model=f"{args.shape} shape, random weights",
                   simulated=False, torch=torch.__version__)
    device = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{header['machine']['cpu']} (native bf16: {header['machine']['native_bf16']})"
    print(f"device: {device}; torch {torch.__version__}; shape {args.shape}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtypes:
            engines = {name: build(path, CONFIGS[name][0], CONFIGS[name][2], dtype, num_pages, args.device)
                       for name in args.configs}
            for context in args.contexts:
                for batch in args.batches:
                    outs = {n: decode_batch(engines[n], batch, context, CONFIGS[n][1]) for n in args.configs}
                    best = {n: float("inf") for n in args.configs}
                    for n in args.configs:
                        time_step(engines[n].llm_engine.runner, outs[n])  # warm-up
                    for _ in range(args.repeats):
                        for n in args.configs:
                            best[n] = min(best[n], time_step(engines[n].llm_engine.runner, outs[n], clock))
                    for n in args.configs:
                        rows.append(dict(threads=threads, dtype=dtype, batch=batch, context=context, config=n,
                                         step_ms=best[n] * 1e3))
                        if args.flop_model and HIDDEN_BASES.get(n) in best:  # 4 hidden^2 FLOPs a token and layer
                            m = engines[n].llm_engine.runner.model.shape
                            gf = projection_gflops(batch * context, m.hidden_size, dtype, args.device, args.repeats)
                            extra = (best[n] - best[HIDDEN_BASES[n]]) / batch / context * 1e6
                            model = 4 * m.hidden_size**2 * m.num_layers / gf / 1e3
                            rows[-1].update(extra_us_per_token=extra, flop_model_us_per_token=model, gemm_gflops=gf)
                            print(f"  {n}: extra {extra:.1f} us per context token over {HIDDEN_BASES[n]}, "
                                  f"FLOP model {model:.1f} ({gf:.0f} GFLOP/s)")
                    ref = best.get("torch kv")
                    line = "  ".join(f"{n} {best[n] * 1e3:7.1f}" for n in args.configs)
                    ratio = f"  | torch kv / fast kv {ref / best['fast kv']:.2f}x" if ref and "fast kv" in best else ""
                    ratio += "".join(f"  | {n} / {b} {best[n] / best[b]:.2f}x" for n, b in INT8_BASES.items()
                                     if n in best and b in best)
                    print(f"threads={threads} {dtype:8s} B={batch:3d} ctx={context:5d} ms: {line}{ratio}", flush=True)
            if args.flop_model:
                name = next(iter(engines))
                rho = calibrate_rho(engines[name].llm_engine.runner)
                rhos[f"threads={threads} {dtype}"] = dict(config=name, ms_per_page=rho.seconds_per_page * 1e3,
                                                          us_per_token=rho.seconds_per_token * 1e6, r2=rho.r2)
                print(f"calibrated rho ({name}): {rho.seconds_per_page * 1e3:.3f} ms per page (r2 {rho.r2:.3f})")
            if args.profile and args.profile_config in engines:
                out = decode_batch(engines[args.profile_config], args.profile_batch, args.profile_context,
                                   CONFIGS[args.profile_config][1])
                key = f"{args.profile_config} threads={threads} {dtype} B={args.profile_batch} ctx={args.profile_context}"
                runner = engines[args.profile_config].llm_engine.runner
                runner.execute(out)
                profiles[key] = group_ops(op_table(lambda: runner.execute(out), 5))
                print(f"profile {key}: " + ", ".join(f"{g} {ms:.1f} ms" for g, ms in profiles[key].items()))
            del engines
    if args.json:
        write_json(args.json, dict(device=device, cpu=header["machine"]["cpu"],
                                   native_bf16=header["machine"]["native_bf16"], torch=torch.__version__,
                                   argv=sys.argv[1:], clock=args.clock, model=header["run"]["model"], rows=rows,
                                   profiles=profiles, rho=rhos), header)
    return 0


if __name__ == "__main__":
    sys.exit(main())

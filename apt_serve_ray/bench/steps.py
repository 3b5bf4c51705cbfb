"""One engine step built by hand and timed whole (``ModelRunner.execute``: batch preparation, forward,
lm-head, sampling), for the benchmarks that time steps rather than serve requests: decode batches of
any cache kind, prefills and mixed steps of any shape, on pages filled with random contents."""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from apt_serve_ray import LLM
from apt_serve_ray.worker.calibration import _fake_request
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.output import ScheduledChunk, SchedulerOutput


def build(path: str, backend: str, fused: bool, dtype: str, num_pages: int, device: str) -> LLM:
    """An engine over ``path`` whose steps are built here: ``backend`` "fast" is the device's own
    (C++ kernels on CPU, Triton on CUDA), every cache kind available, nothing calibrated at start."""
    if backend == "fast":
        backend = "triton" if device == "cuda" else "cpu"
    return LLM(path, dtype=dtype, num_pages=num_pages, attention_backend=backend, cache_proj_optimize=fused,
               device=device, force_hidden=False, enable_watermarks=False, calibrate_rho=False, max_model_len=2048,
               cache_kinds=("hidden", "kv-int8", "hidden-int8"))


def fake_step(runner, shape: list[tuple[int, int]], kind: CacheKind = CacheKind.KV,
              pages: list[int] | None = None) -> SchedulerOutput:
    """A step of ``shape``: per request (context after the step, tokens computed in it), each on its
    own pages of ``kind`` (``pages``: the pages to use, in order; default: from page 0 up)."""
    layout, vocab = runner.layout, runner.model.shape.vocab_size
    need = [layout.num_pages_for(context, kind) for context, _ in shape]
    pages = list(range(sum(need))) if pages is None else list(pages)
    if len(pages) < sum(need):
        raise ValueError(f"{shape} in {kind.value} pages needs {sum(need)} pages, got {len(pages)}")
    requests, start = [], 0
    for i, ((context, new), n) in enumerate(zip(shape, need)):
        requests.append(_fake_request(i, context, new, vocab, pages[start:start + n], kind))
        start += n
    return SchedulerOutput([ScheduledChunk(r, new) for r, (_, new) in zip(requests, shape)])


def decode_batch(llm: LLM, batch: int, context: int, kind: CacheKind) -> SchedulerOutput:
    """``batch`` requests of ``context`` tokens decoding one token each, on pages of random contents."""
    runner = llm.llm_engine.runner
    need = runner.layout.num_pages_for(context, kind)
    if need * batch > runner.num_pages:
        raise ValueError(f"{batch} x {context} tokens of {kind.value} do not fit {runner.num_pages} pages")
    fill_pages(runner.storage, kind, need * batch)
    return fake_step(runner, [(context, 1)] * batch, kind)


def fill_pages(storage, kind: CacheKind, num_pages: int) -> None:
    """Random contents in the first ``num_pages`` pages of every layer, in ``kind``'s layout. Pages never
    written read as the kernel's shared zero page: every byte an L1 hit, which hides what a kind's
    bytes cost (and int8 pages need finite scales)."""
    g = torch.Generator().manual_seed(0)
    for layer in range(len(storage.layers)):
        if kind.is_int8:
            data, scales = ((storage.kv_int8, storage.kv_int8_scale) if kind is CacheKind.KV_INT8
                            else (storage.hidden_int8, storage.hidden_int8_scale))
            pages = data[layer][:num_pages]
            pages.copy_(torch.randint(-127, 128, pages.shape, generator=g, dtype=torch.int8))
            scales[layer][:num_pages].uniform_(0.005, 0.02, generator=g)
        else:
            storage.layers[layer][:num_pages].normal_(generator=g)


def time_step(runner, out: SchedulerOutput, clock=time.perf_counter) -> float:
    """Seconds of one ``runner.execute(out)`` on ``clock`` (the device synchronised around it)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t = clock()
    runner.execute(out)
    sync()
    return clock() - t


def time_steps(runner, out: SchedulerOutput, repeats: int, reduce=min, clock=time.perf_counter) -> float:
    """One warm-up, then ``reduce`` (min: interference only ever adds time) over ``repeats`` timings."""
    runner.execute(out)
    return float(reduce([time_step(runner, out, clock) for _ in range(repeats)]))


# Where a step's time goes -----------------------------------------------------------------------------
OP_GROUPS = (  # torch.profiler op names by substring, first match wins
    ("sampling", ("argmax", "multinomial", "exponential", "topk", "aten::sort", "log_softmax")),
    ("linear layers (incl. lm-head)", ("addmm", "aten::mm", "aten::linear", "mkldnn")),
    ("attention (kernels / sdpa / bmm / softmax)", ("apt_serve::", "apt_cpu_attention", "kv_decode", "hidden_",
                                                   "scaled_dot", "bmm", "softmax", "matmul")),
    ("cache writes / row scatter", ("index_put", "index_copy")),
    ("paged gather (index / index_select)", ("aten::index", "gather")),
    ("copies / layout", ("copy_", "contiguous", "aten::cat", "aten::stack", "clone", "aten::to")),
    ("norms / activations / residual", ("norm", "add", "mul", "clamp", "relu", "silu", "gelu", "embedding",
                                        "masked_fill", "where", "div", "rsqrt", "pow", "mean")),
)


def op_table(step, num_steps: int) -> list[tuple[str, float, int]]:
    """``(op, self CPU ms per step, calls per step)`` of ``num_steps`` calls of ``step()`` under
    torch.profiler (self time: every op counted once, in the op that spent it), the heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    rows = [(e.key, e.self_cpu_time_total / 1e3 / num_steps, e.count // num_steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])


def group_ops(rows: list[tuple[str, float, int]]) -> dict[str, float]:
    """``op_table``'s milliseconds summed by ``OP_GROUPS``, the heaviest first."""
    groups: dict[str, float] = {}
    for key, ms, _calls in rows:
        label = next((g for g, keys in OP_GROUPS if any(k in key for k in keys)), "other ops")
        groups[label] = groups.get(label, 0.0) + ms
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


class StepTimers:
    """Wall time of chosen callables, accumulated per engine step (``take()`` after each step): ``on``
    a runner, its input preparation, forward, lm-head and sampler, so that a step splits into
    ``PARTS`` (``breakdown``). Nothing in the engine is edited: instance attributes shadow the methods."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:  # the engine moved on; that part then counts as "other"
            print(f"note: {type(obj).__name__}.{name} not found; not timed separately", file=sys.stderr)
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[key] = self.step.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)  # instance attribute shadows the method; the class is untouched

    @classmethod
    def on(cls, runner) -> "StepTimers":
        timers = cls()
        timers.wrap(runner, "_prepare", "prepare_s")
        timers.wrap(runner.model, "forward", "forward_s")
        timers.wrap(runner.model, "compute_logits", "logits_s")
        timers.wrap(runner.sampler, "sample", "sample_s")
        return timers

    def take(self) -> dict[str, float]:
        out, self.step = self.step, {}
        return out


PARTS = ("schedule_s", "prepare_s", "forward_s", "logits_s", "sample_s", "execute_other_s", "postprocess_s")


def split_step(s: dict) -> dict:
    """One step's record (the engine's ``last_step`` times and ``StepTimers.take()``) in ``PARTS``."""
    model = s.get("forward_s", 0.0) + s.get("logits_s", 0.0)
    parts = {k: s.get(k, 0.0) for k in ("schedule_s", "prepare_s", "forward_s", "logits_s", "sample_s")}
    parts["execute_other_s"] = s["execute_s"] - model - parts["prepare_s"] - parts["sample_s"]
    # total_s runs from the top of step() to the end of postprocessing; what is outside
    # schedule + execute is watermark/pool upkeep and turning sampled tokens into outputs.
    parts["postprocess_s"] = s["total_s"] - s["schedule_s"] - s["execute_s"]
    parts["total_s"] = s["total_s"]
    return parts


def breakdown(steps: list[dict]) -> dict:
    """Summed seconds per part for all, prefill-carrying and decode-only steps, plus shares."""
    groups = {"all": steps,
              "prefill": [s for s in steps if s["num_tokens"] > s["num_seqs"]],
              "decode": [s for s in steps if s["num_tokens"] == s["num_seqs"]]}
    out = {}
    for name, group in groups.items():
        if not group:
            continue
        parts = [split_step(s) for s in group]
        sums = {k: sum(p[k] for p in parts) for k in (*PARTS, "total_s")}
        total = sums["total_s"]
        model = sums["forward_s"] + sums["logits_s"]
        out[name] = {
            "num_steps": len(group),
            "seconds": sums,
            "share": {k: sums[k] / total for k in PARTS},
            "overhead_share": (total - model) / total,
            "median_step_ms": 1e3 * statistics.median(s["total_s"] for s in group),
            "median_overhead_ms": 1e3 * statistics.median(p["total_s"] - p["forward_s"] - p["logits_s"] for p in parts),
            "tokens": sum(s["num_tokens"] for s in group),
        }
    return out

"""Linear layers with the weight prepacked for oneDNN on CPU.

``F.linear`` on CPU re-reads the weight in its stored layout on every call; for the few rows of a
decode step the layer is bound by reading the weight, and oneDNN's blocked layout reads it about
twice as fast. Measured on this project's AVX-512 CPU, one thread, all linear layers of OPT-125m
(12 layers + the logits): bf16 1 row 16.5 -> 7.8 ms, 16 rows 22.7 -> 14.3 ms; float32 1 row 28.3 ->
13.8 ms, 16 rows 75.4 -> 27.8 ms, 384 rows (a prefill chunk) 960 -> 430 ms (MKL's sgemm behind
``F.linear`` reaches ~100 GFLOP/s there, oneDNN ~220). In bf16 the results are bit-identical to
``F.linear``; in float32 oneDNN sums in another order (differences ~1e-4 relative to the output,
well inside the 1e-3 the reference tests allow). ``APT_SERVE_PACKED_LINEAR=0`` turns packing off
(for A/B measurements). (A hand-written AVX-512 GEMV for decode-sized batches was tried on an AMD Zen 5 and
lost to the packed layout in both dtypes; the panels below, which prefetch into L2, win on an Intel Xeon.)

Panels (``kernels/csrc/cpu_panel.cpp``, issue 41): a second layout of the weight, in panels of W output channels
read front to back (``pack_panels``, ``pack_panels_bf16``), for the few rows of a decode step, which are bound by
reading the weight. ``APT_SERVE_PANEL_LINEAR=0`` turns them off.

- float32 on CPUs with AVX2 and not AVX-512: W = 16, for steps of at most ``PANEL_MAX_ROWS`` rows. Measured on an
  AVX2 EPYC (``benchmarks/panel_linear.py``, JSON ``docs/benchmarks/engine_speed/panel_linear_avx2.json``),
  OPT-125m's linears at 1-6 rows take 0.83-1.04x oneDNN's time at one thread and 0.84-0.91x at two, 0.69-0.81x
  beside the idle Serve app's wake-ups at two (the panels are shared out from a counter, so a preempted thread holds
  up two panels, not the call); a whole decode step of one request 0.74x (one thread) and 0.82x (two) quiet. Eight
  rows (two passes over the weight) take 1.07-1.11x, sixteen 1.4x: oneDNN keeps those, and its copy is kept too.
- float32 and bf16 on CPUs with AVX-512: W = 64, prefetched 4 KB ahead into L2, bf16 widened to float32 in
  registers and summed by FMAs (bf16 only where the CPU lacks AMX, whose tiles oneDNN uses; not measured here).
  Measured on an Intel Xeon with AVX512-BF16 and no AMX (2026-12-07, ``benchmarks/panel_linear.py --shape opt-350m
  --dtype bfloat16|float32``, JSON ``docs/benchmarks/engine_speed/panel_linear_*_xeon_opt350m.json``): bf16,
  OPT-350m's linears 0.65-0.82x oneDNN's time at 1-64 rows, one thread and two, quiet and beside noise; a decode
  step of one request 0.80x / 0.70x at one thread (quiet / beside noise) and 0.77x / 0.59x at two; a 512-token
  prefill step 0.93x / 0.97x and 0.94x / 0.91x (against the float32 ``wide`` path below). float32: the linears
  0.74-1.02x at 1-16 rows; a decode step of one request 0.95x / 0.99x at one thread, 0.84x / 0.79x at two (a first
  run: 0.89x / 0.93x, 0.86x / 0.75x).
  Where bf16 panels measure faster than oneDNN by ``PANEL_ALL_ROWS_GAIN`` at 64 and 512 rows (``panels_all_rows``,
  once per process and thread count; 0.66-0.76x on that Xeon) they take every step and oneDNN's copy is not kept;
  elsewhere, and always in float32, they take steps of at most ``PANEL_MAX_ROWS`` rows and oneDNN the rest from its
  own copy: float32 panels measured 0.89-1.14x oneDNN's GEMM at 64 and 512 rows on that Xeon and a 512-token prefill
  step through them 1.22x quiet at two threads. ``APT_SERVE_PANEL_ALL_ROWS=0`` / ``=1`` decides it unmeasured.

``weight_bytes`` counts every copy kept.

Where bf16 panels are off, bf16 layers run steps of many rows (prefill chunks) as a float32 GEMM over the weight unpacked from
oneDNN's layout on the fly, where that is faster on this CPU (``wide_rows``, measured once per process
and thread count when the first bf16 layer is built). AVX512-BF16 without AMX (an Intel Xeon under KVM
with AMX hidden, 2026-12-07) computes bf16 dot products no faster than float32 FMAs: oneDNN's bf16 GEMM
(``brg_matmul:avx512_core_bf16``) reached 0.6-0.7x the FLOP rate of MKL's float32 one. OPT-125m's
linears at 384-512 rows took 0.63-0.80x the time that way, the weight unpacked each call included, and a
whole prefill step of 384 or 512 tokens 0.78-0.85x at one thread and 0.83-1.00x at two, over three runs
(``benchmarks/wide_linear.py``, ``docs/benchmarks/engine_speed/wide_linear_xeon*.json``). Where bf16 measures faster (AMX; the AMD Zen 5 CPUs
these figures' earlier passes ran on, whose bf16 steps took about half their float32 time) nothing changes.
No second copy of the weight is kept. ``APT_SERVE_WIDE_LINEAR=0`` turns it
off, ``=N`` sets the row count without measuring.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger("apt_serve_ray")


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on CPU are packed: bf16 or float32, oneDNN present, the op works
    (checked on a small case against ``F.linear``), and not switched off."""
    if os.environ.get("APT_SERVE_PACKED_LINEAR", "1") == "0" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.ones(8, 4, dtype=dtype), torch.ones(2, 4, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w), rtol=1e-3, atol=1e-3))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN packed linear unavailable (%s): using F.linear", exc)
        return False


WIDE_ROWS = (128, 256, 384, 512)  # the row counts ``wide_rows`` tries, the largest first
WIDE_GAIN = 0.85  # the float32 GEMM's time over bf16's under which it is used


def fastest(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_wide() -> tuple[int | None, dict[int, float]]:
    """At the current compute threads: the fewest rows (of ``WIDE_ROWS``) from which a bf16 linear runs faster
    as a float32 GEMM over its weight unpacked on the fly than as oneDNN's bf16 GEMM (None where it does not, by
    ``WIDE_GAIN``, at the most rows), and the time ratios measured, on a 3,072 x 768 layer (~0.2-0.5 s)."""
    g = torch.Generator().manual_seed(0)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(3072, 768, generator=g).to(torch.bfloat16))
    found, ratios = None, {}
    for rows in sorted(WIDE_ROWS, reverse=True):
        x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
        bf16 = fastest(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        wide = fastest(lambda: F.linear(x.float(), packed.to_dense(torch.float32)).to(torch.bfloat16))
        ratios[rows] = round(wide / bf16, 3)
        if wide >= WIDE_GAIN * bf16:
            break
        found = rows
    return found, ratios


@functools.cache
def wide_rows(threads: int) -> int | None:
    """``measure_wide``'s row count at ``threads`` threads, once per process (``APT_SERVE_WIDE_LINEAR``: 0 off,
    N that count unmeasured)."""
    setting = os.environ.get("APT_SERVE_WIDE_LINEAR", "auto")
    if setting != "auto":
        return int(setting) or None
    if not packing_available(torch.bfloat16):
        return None
    found, ratios = measure_wide()
    logger.info("bf16 linears, %d thread(s): %s (float32 over bf16 at %s rows)", threads,
                f"float32 from {found} rows" if found else "bf16 at every size", ratios)
    return found


PANEL_MAX_ROWS = 6  # rows a step sends to the panels (one pass over the weight) where oneDNN's copy is kept


def _kernels_say(op: str) -> bool:
    try:
        from apt_serve_ray.kernels import cpu_attention

        cpu_attention.load()
        return bool(getattr(torch.ops.apt_serve, op)())
    except RuntimeError as exc:
        logger.info("panel linears unavailable (%s)", exc)
        return False


def _has_flag(flag: str) -> bool:
    from apt_serve_ray.worker.cpu_info import cpuinfo_field

    return flag in (cpuinfo_field("flags") or "").split()


@functools.cache
def panels_available() -> bool:
    """Whether float32 layers keep panels: our kernel built with AVX-512 (64-channel panels) or with AVX2 and FMA
    (16-channel), unless ``APT_SERVE_PANEL_LINEAR=0``."""
    if os.environ.get("APT_SERVE_PANEL_LINEAR", "auto") == "0":
        return False
    return _kernels_say("panel_native")


@functools.cache
def bf16_panels_available() -> bool:
    """Whether bf16 layers keep panels (64 channels of input pairs): our kernel built with AVX-512, the CPU without
    AMX (whose tiles oneDNN uses; not measured here), unless ``APT_SERVE_PANEL_LINEAR=1``; ``=0`` turns them off."""
    setting = os.environ.get("APT_SERVE_PANEL_LINEAR", "auto")
    if setting == "0" or (setting != "1" and _has_flag("amx_bf16")):
        return False
    return _kernels_say("panel_wide_native")


@functools.cache
def panel_width() -> int:
    """Channels in a float32 panel: 64 where the kernels are built with AVX-512, 16 (AVX2) elsewhere."""
    return 64 if _kernels_say("panel_wide_native") else 16


def pack_panels(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """float32 [N, K] -> [N / W, K, W], N padded to W with zero channels: each panel's W channels side by side for
    every input, read front to back by ``cpu_panel.cpp``. W: ``panel_width()`` unless given."""
    width = width or panel_width()
    n, k = weight.shape
    npad = -(-n // width) * width
    padded = torch.zeros(npad, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(npad // width, width, k).transpose(1, 2).contiguous()


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [N / 64, K / 2, 64, 2], N padded to 64 with zero channels: for each pair of inputs,
    a panel's 64 channels side by side, read front to back by ``cpu_panel.cpp``."""
    n, k = weight.shape
    npad = -(-n // 64) * 64
    padded = torch.zeros(npad, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(npad // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` from the weight's float32 panels (``pack_panels``)."""
    return torch.ops.apt_serve.panel_linear(x, panels, bias, n)


def panel_linear_bf16(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` from the weight's bf16 panels (``pack_panels_bf16``), float32 bias: bf16 x of any rows."""
    return torch.ops.apt_serve.panel_linear_bf16(x, panels, bias, n)


def pack_for(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s panels in its dtype's layout."""
    return pack_panels_bf16(weight) if weight.dtype == torch.bfloat16 else pack_panels(weight)


def panel_call(x: torch.Tensor, panels: torch.Tensor, bias32: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` through ``panels`` of either dtype (x in the panels' dtype, bias float32)."""
    if panels.dtype == torch.bfloat16:
        return panel_linear_bf16(x, panels, bias32, n)
    return panel_linear(x, panels, bias32, n)


PANEL_WIDE_ROWS = (64, 512)  # the row counts ``measure_panels`` tries beyond a decode step's
PANEL_ALL_ROWS_GAIN = 0.95  # panels' time over oneDNN's under which they take every step (a clear win only: the
# choice sets the weights' memory, one copy or two, and should not flip between starts on noise)


def measure_panels(dtype: torch.dtype) -> dict[int, float]:
    """At the current compute threads: 64-channel panels' time over oneDNN's packed GEMM in ``dtype`` on a
    3,072 x 768 layer at each of ``PANEL_WIDE_ROWS`` rows (~0.1-0.3 s). ``RuntimeError`` where they are not built."""
    if not _kernels_say("panel_wide_native"):  # also loads the kernels, whose ops this calls
        raise RuntimeError("64-channel panel linears are not built here (they need AVX-512)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 768, generator=g).to(dtype)
    packed, panels = torch.ops.mkldnn._reorder_linear_weight(w), pack_for(w)
    ratios = {}
    for rows in PANEL_WIDE_ROWS:
        x = torch.randn(rows, 768, generator=g).to(dtype)
        onednn = fastest(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        ratios[rows] = round(fastest(lambda: panel_call(x, panels, None, 3072)) / onednn, 3)
    return ratios


@functools.cache
def panels_all_rows(dtype: torch.dtype, threads: int) -> bool:
    """Whether ``dtype``'s panels take steps of every size, so that oneDNN's copy of the weight is not kept: bf16
    panels that measure faster than oneDNN by ``PANEL_ALL_ROWS_GAIN`` at each of ``PANEL_WIDE_ROWS`` rows at
    ``threads`` threads (once per process), or where oneDNN's packing is unavailable; float32 never unless set.
    ``APT_SERVE_PANEL_ALL_ROWS=1`` / ``=0``: yes / no unmeasured (``=1`` for float32 too, on AVX-512)."""
    if dtype == torch.float32 and panel_width() != 64:
        return False  # AVX2's 16-channel panels: one pass of rows only (docstring)
    setting = os.environ.get("APT_SERVE_PANEL_ALL_ROWS", "auto")
    if setting != "auto":
        return setting == "1"
    if dtype == torch.float32:
        return False  # oneDNN's float32 GEMM is level with the panels from 64 rows up (docstring): not measured
    if not packing_available(dtype):
        return True
    ratios = measure_panels(dtype)
    verdict = all(r <= PANEL_ALL_ROWS_GAIN for r in ratios.values())
    logger.info("%s linears, %d thread(s): panels %s (their time over oneDNN's at %s rows)", dtype, threads,
                "for every step" if verdict else f"for steps of at most {PANEL_MAX_ROWS} rows", ratios)
    return verdict


class Linear:
    """``y = x W^T + b``. ``keep_weight``: keep the plain weight too (for callers that slice it)."""

    __slots__ = ("weight", "bias", "bias32", "packed", "panels", "all_rows", "out_features", "wide")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, keep_weight: bool = False) -> None:
        self.bias = bias
        self.packed = self.panels = self.bias32 = None
        self.wide = self.all_rows = False
        self.out_features = weight.shape[0]
        cpu2d = weight.device.type == "cpu" and weight.dim() == 2
        if cpu2d and ((weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bf16_panels_available())
                      or (weight.dtype == torch.float32 and panels_available())):
            self.panels = pack_for(weight)
            self.bias32 = None if bias is None else bias.float().contiguous()
            # measured now, at the threads the model is built with (the engine sets them first)
            self.all_rows = panels_all_rows(weight.dtype, torch.get_num_threads())
        if weight.device.type == "cpu" and not self.all_rows and packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            # measured now, at the threads the model is built with (the engine sets them first)
            self.wide = weight.dtype == torch.bfloat16 and wide_rows(torch.get_num_threads()) is not None
        self.weight = weight if keep_weight or (self.packed is None and not self.all_rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (self.panels is not None and x.dim() == 2 and (self.all_rows or (  # all rows: there is no other copy
                x.shape[0] <= PANEL_MAX_ROWS and x.dtype == self.panels.dtype and not x.requires_grad))):
            return panel_call(x.to(self.panels.dtype), self.panels, self.bias32, self.out_features)
        if (self.wide and x.dim() == 2 and x.shape[0] >= WIDE_ROWS[0] and x.dtype == torch.bfloat16
                and not x.requires_grad):
            wide = wide_rows(torch.get_num_threads())  # the threads now (a benchmark may change them)
            if wide is not None and x.shape[0] >= wide:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.packed.to_dense(torch.float32), bias).to(torch.bfloat16)
        if self.packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.weight is None:  # packed or panels only, and an input of another rank: flatten to rows
            return self(x.reshape(-1, x.shape[-1])).unflatten(0, x.shape[:-1])
        return F.linear(x, self.weight, self.bias)


def model_linears(model) -> list[Linear]:
    """The model's ``Linear`` layers, found by walking its attributes (for benchmarks that time or switch them)."""
    found, seen, todo = [], set(), [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Linear):
            found.append(obj)
            continue
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
            todo.extend(v for v in vars(obj).values() if not isinstance(v, (torch.Tensor, str, int, float)))
    return found


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, quantization: str | None = None,
                keep_weight: bool = False, keep_rows: int = 0):
    """A ``Linear``, or with ``quantization`` ("int8" / "int4"), or for a checkpoint's codes (a
    ``checkpoint_quant.QuantizedWeight``), a layer whose weight stays quantized (``quant.py``), its last
    ``keep_rows`` rows also kept dequantized (``kept_rows``)."""
    from apt_serve_ray.models.checkpoint_quant import QuantizedWeight

    if not isinstance(weight, QuantizedWeight) and quantization not in ("int8", "int4"):
        return Linear(weight, bias, keep_weight=keep_weight)  # also a layer a quantized checkpoint left at full width
    from apt_serve_ray.models.quant import quantized_linear

    return quantized_linear(weight, bias, quantization, keep_rows)


def weight_bytes(layer) -> int:
    """Bytes a linear layer holds its weight in (packed, quantized or plain; panels too)."""
    nbytes = getattr(layer, "nbytes", None)
    if nbytes is not None:
        return nbytes
    copies = [getattr(layer, "packed", None), getattr(layer, "panels", None)]
    if copies[0] is None:
        copies[0] = layer.weight
    return sum(w.numel() * w.element_size() for w in copies if w is not None)

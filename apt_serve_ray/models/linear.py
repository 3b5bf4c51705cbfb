"""Linear layers with the weight prepacked for oneDNN on CPU.

``F.linear`` on CPU re-reads the weight in its stored layout on every call; for the few rows of a
decode step the layer is bound by reading the weight, and oneDNN's blocked layout reads it about
twice as fast. Measured on this project's AVX-512 CPU, one thread, all linear layers of OPT-125m
(12 layers + the logits): bf16 1 row 16.5 -> 7.8 ms, 16 rows 22.7 -> 14.3 ms; float32 1 row 28.3 ->
13.8 ms, 16 rows 75.4 -> 27.8 ms, 384 rows (a prefill chunk) 960 -> 430 ms (MKL's sgemm behind
``F.linear`` reaches ~100 GFLOP/s there, oneDNN ~220). In bf16 the results are bit-identical to
``F.linear``; in float32 oneDNN sums in another order (differences ~1e-4 relative to the output,
well inside the 1e-3 the reference tests allow). ``APT_SERVE_PACKED_LINEAR=0`` turns packing off
(for A/B measurements). (A hand-written AVX-512 GEMV for decode-sized batches was tried and lost to
the packed layout in both dtypes.)

On CPUs with AVX2 but not AVX-512, float32 layers also keep their weight in panels of 16 output channels
for steps of at most ``PANEL_MAX_ROWS`` rows (``kernels/csrc/cpu_panel.cpp``; issue 41). Measured on an
AVX2 EPYC (``benchmarks/panel_linear.py``, JSON ``docs/benchmarks/engine_speed/panel_linear_avx2.json``),
OPT-125m's linears at 1-6 rows take 0.83-1.04x oneDNN's time at one thread and 0.84-0.91x at two, 0.69-0.81x
beside the idle Serve app's wake-ups at two (the panels are shared out from a counter, so a preempted
thread holds up two panels, not the call); a whole decode step of one request 0.74x (one thread) and
0.82x (two) quiet. Eight rows (two passes over the weight) take 1.07-1.11x, sixteen 1.4x: oneDNN keeps those.
The panels are a second copy of the weight (``weight_bytes`` counts both).
``APT_SERVE_PANEL_LINEAR=0`` turns them off, ``=1`` on where AVX-512 is present too.

bf16 layers on a CPU with AVX-512 and no AMX keep their weight in panels of 64 channels instead
(``pack_panels_bf16``; the kernel widens each bf16 pair to float32 in registers and sums by FMAs). Measured on an
Intel Xeon with AVX512-BF16 and no AMX (2026-12-07, ``benchmarks/panel_linear.py --dtype bfloat16 --shape
opt-350m``, JSON ``docs/benchmarks/engine_speed/panel_linear_bf16_xeon_opt350m.json``): OPT-350m's linears took
0.65-0.75x oneDNN's time at 1-64 rows, one thread and two, quiet and beside noise; a whole decode step of one
request 0.83x / 0.80x at one thread (quiet / beside noise) and 0.67x / 0.62x at two; a 512-token prefill step
0.88x / 1.05x and 0.79x / 0.90x (against the float32 ``wide`` path below). Where they measure no slower than
oneDNN at 64 and 512 rows (``bf16_panels_all_rows``, once per process and thread count) they take every step and
oneDNN's copy is not kept; elsewhere they take steps of at most ``PANEL_MAX_ROWS`` rows and oneDNN the rest (two
copies). With AMX, oneDNN's tile kernels keep every step (not measured here: no AMX CPU was lent).

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


PANEL_MAX_ROWS = 6  # rows a step sends to the panels (one pass over the weight); more go to oneDNN


@functools.cache
def panels_available() -> bool:
    """Whether float32 layers keep panels for small steps: our kernel built with AVX2 and FMA, and the CPU
    without AVX-512 (where oneDNN's packed layout won when measured) unless ``APT_SERVE_PANEL_LINEAR=1``;
    ``=0`` turns them off."""
    setting = os.environ.get("APT_SERVE_PANEL_LINEAR", "auto")
    if setting == "0":
        return False
    from apt_serve_ray.worker.cpu_info import cpuinfo_field

    if setting != "1" and "avx512f" in (cpuinfo_field("flags") or "").split():
        return False
    try:
        from apt_serve_ray.kernels import cpu_attention

        cpu_attention.load()
        return bool(torch.ops.apt_serve.panel_native())
    except RuntimeError as exc:
        logger.info("float32 panel linears unavailable (%s)", exc)
        return False


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [N / 16, K, 16], N padded to 16 with zero channels: each panel's 16 channels
    side by side for every input, read front to back by ``cpu_panel.cpp``."""
    n, k = weight.shape
    npad = -(-n // 16) * 16
    padded = torch.zeros(npad, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(npad // 16, 16, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` from the weight's panels (``pack_panels``): float32 x of at most a few rows."""
    return torch.ops.apt_serve.panel_linear(x, panels, bias, n)


@functools.cache
def bf16_panels_available() -> bool:
    """Whether bf16 layers keep their weight in panels of 64 channels (``cpu_panel.cpp``): our kernel built with
    AVX-512, the CPU without AMX (whose tiles oneDNN uses; not measured here), unless ``APT_SERVE_PANEL_LINEAR=1``;
    ``=0`` turns them off."""
    setting = os.environ.get("APT_SERVE_PANEL_LINEAR", "auto")
    if setting == "0":
        return False
    from apt_serve_ray.worker.cpu_info import cpuinfo_field

    if setting != "1" and "amx_bf16" in (cpuinfo_field("flags") or "").split():
        return False
    try:
        from apt_serve_ray.kernels import cpu_attention

        cpu_attention.load()
        return bool(torch.ops.apt_serve.panel_bf16_native())
    except RuntimeError as exc:
        logger.info("bf16 panel linears unavailable (%s)", exc)
        return False


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [N / 64, K / 2, 64, 2], N padded to 64 with zero channels: for each pair of inputs,
    a panel's 64 channels side by side, read front to back by ``cpu_panel.cpp``."""
    n, k = weight.shape
    npad = -(-n // 64) * 64
    padded = torch.zeros(npad, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(npad // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear_bf16(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` from the weight's bf16 panels (``pack_panels_bf16``), float32 bias: bf16 x of any rows."""
    return torch.ops.apt_serve.panel_linear_bf16(x, panels, bias, n)


PANEL_WIDE_ROWS = (64, 512)  # the row counts ``measure_bf16_panels`` tries beyond a decode step's


def measure_bf16_panels() -> dict[int, float]:
    """At the current compute threads: bf16 panels' time over oneDNN's packed bf16 GEMM on a 3,072 x 768 layer at
    each of ``PANEL_WIDE_ROWS`` rows (~0.1-0.3 s)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 768, generator=g).to(torch.bfloat16)
    packed, panels = torch.ops.mkldnn._reorder_linear_weight(w), pack_panels_bf16(w)
    ratios = {}
    for rows in PANEL_WIDE_ROWS:
        x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
        onednn = fastest(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        ratios[rows] = round(fastest(lambda: panel_linear_bf16(x, panels, None, 3072)) / onednn, 3)
    return ratios


@functools.cache
def bf16_panels_all_rows(threads: int) -> bool:
    """Whether bf16 panels take steps of every size, so that oneDNN's copy of the weight is not kept: they measure
    no slower than oneDNN at each of ``PANEL_WIDE_ROWS`` rows at ``threads`` threads (once per process), or
    oneDNN's packing is unavailable. ``APT_SERVE_PANEL_ALL_ROWS=1`` / ``=0``: yes / no unmeasured."""
    setting = os.environ.get("APT_SERVE_PANEL_ALL_ROWS", "auto")
    if setting != "auto":
        return setting == "1"
    if not packing_available(torch.bfloat16):
        return True
    ratios = measure_bf16_panels()
    verdict = all(r <= 1.0 for r in ratios.values())
    logger.info("bf16 linears, %d thread(s): panels %s (their time over oneDNN's at %s rows)", threads,
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
        if (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % 2 == 0 and bf16_panels_available()):
            self.panels = pack_panels_bf16(weight)
            self.bias32 = None if bias is None else bias.float().contiguous()
            # measured now, at the threads the model is built with (the engine sets them first)
            self.all_rows = bf16_panels_all_rows(torch.get_num_threads())
        if weight.device.type == "cpu" and not self.all_rows and packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            # measured now, at the threads the model is built with (the engine sets them first)
            self.wide = weight.dtype == torch.bfloat16 and wide_rows(torch.get_num_threads()) is not None
        if (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
                and (bias is None or bias.dtype == torch.float32) and panels_available()):
            self.panels = pack_panels(weight)
            if bias is not None:
                self.bias = bias.contiguous()
        self.weight = weight if keep_weight or (self.packed is None and not self.all_rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and not x.requires_grad:
            if self.panels.dtype == torch.bfloat16:
                if self.all_rows or (x.shape[0] <= PANEL_MAX_ROWS and x.dtype == torch.bfloat16):
                    return panel_linear_bf16(x.to(torch.bfloat16), self.panels, self.bias32, self.out_features)
            elif x.shape[0] <= PANEL_MAX_ROWS and x.dtype == torch.float32:
                return panel_linear(x, self.panels, self.bias, self.out_features)
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

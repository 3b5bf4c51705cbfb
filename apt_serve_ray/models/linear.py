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
"""

from __future__ import annotations

import functools
import logging
import os

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


class Linear:
    """``y = x W^T + b``. ``keep_weight``: keep the plain weight too (for callers that slice it)."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, keep_weight: bool = False) -> None:
        self.bias = bias
        self.packed = None
        if weight.device.type == "cpu" and packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.weight = weight if keep_weight or self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.weight is None:  # packed only, and an input of another rank: flatten to rows
            return self(x.reshape(-1, x.shape[-1])).unflatten(0, x.shape[:-1])
        return F.linear(x, self.weight, self.bias)


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
    """Bytes a linear layer holds its weight in (packed, quantized or plain)."""
    nbytes = getattr(layer, "nbytes", None)
    if nbytes is not None:
        return nbytes
    w = layer.packed if getattr(layer, "packed", None) is not None else layer.weight
    return w.numel() * w.element_size()

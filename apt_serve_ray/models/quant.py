"""Linear layers whose weights stay quantized (issue 43, item 1): the memory goes to cache pages.

``quantization`` (EngineConfig, vLLM's name for it) quantizes a full-width checkpoint's linear layers
at load, weight-only (activations stay in the model's dtype), and keeps them packed:

* ``"int8"``: symmetric, one scale per output channel (absmax / 127), multiplied by
  ``torch._weight_int8pack_mm``.
* ``"int4"``: asymmetric groups of 32 along the input dim, ``w = d * q + m`` with ``q`` in 0..15, as GGUF's
  Q4_1 stores them (the default model ships as Q4_1: its weights, dequantized by transformers at load,
  lie on that grid, so quantizing them again gives back its 4-bit codes), multiplied by
  ``torch._weight_int4pack_mm_for_cpu`` (which computes ``(q - 8) * scale + zero``: zero = m + 8d).

What is not quantized: embeddings (a lookup; a tied lm-head shares the embedding, so it keeps it), norms,
biases, and the K/V rows of the attention's input projection where the hidden cache kinds need them at
full width (K/V projected from stored x). The lm-head of an untied model is quantized like the layers.

Speed on this project's CPU (AMD EPYC Zen 5, one thread, bf16 activations; ``benchmarks/quantized_weights.py``,
docs/benchmarks.md, issue 43): at one row, torch's kernels for packed int8 and int4 weights take 0.6-0.7x
the time of the bf16 weight prepacked for oneDNN (``linear.Linear``) in the layers' shapes; at 8 rows
1.3-1.9x and at 32 rows 2.1-2.8x: they are made for a row or two. So quantized weights buy memory (and
time at one stream), not batched throughput; CUDA devices keep full-width weights (no Triton kernel yet).
"""

from __future__ import annotations

import torch

from apt_serve_ray.config import QUANTIZATIONS
INT4_GROUP = 32  # GGUF Q4_0 / Q4_1's block


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 codes [N, K], float32 scales [N]): ``w ~ q * scale`` per output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor,
                  group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes 0..15 [N, K] int32, scales d [N, K / g], minima m [N, K / g], float32):
    ``w ~ d * q + m`` per group of ``group_size`` inputs (the group's min at 0, its max at 15). The codes
    are chosen on the exact grid, so weights already on a Q4_1 grid keep their codes (the kernel then holds
    ``d`` and ``m + 8d`` in the activations' dtype; choosing the codes on a grid rounded to bf16 instead
    agreed less with full width: greedy tokens before the first difference 47% against 80%, issue 43)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = (hi - lo) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scales, lo


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor,
                    group_size: int = INT4_GROUP) -> torch.Tensor:
    """``quantize_int4``'s codes back to float32 weights [N, K] (the reference the kernel is held to)."""
    n, k = q.shape
    w = q.view(n, k // group_size, group_size).float() * scales[..., None] + minima[..., None]
    return w.view(n, k)


class Int8Linear:
    """``y = x (q * scale)^T + b`` with the int8 codes kept packed (1 byte a weight)."""

    __slots__ = ("qweight", "scales", "bias", "kept_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, keep_rows: int = 0) -> None:
        self.qweight, scales = quantize_int8(weight)
        self.scales = scales.to(weight.dtype)
        self.bias = bias
        # The last ``keep_rows`` rows as the kernel sees them, at full width (the K/V rows the hidden
        # cache kinds project stored x with: the same weights as the KV path's, so both kinds agree).
        self.kept_rows = self.dequantize()[len(weight) - keep_rows:].to(weight.dtype) if keep_rows else None

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 [N, K]."""
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class Int4Linear:
    """``y = x (d q + m)^T + b`` with 4-bit codes packed two to a byte, groups of ``INT4_GROUP`` inputs."""

    __slots__ = ("packed", "scales_zeros", "bias", "group_size", "kept_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = INT4_GROUP,
                 keep_rows: int = 0) -> None:
        q, scales, minima = quantize_int4(weight, group_size)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel's form: w = (q - 8) * scale + zero, [K / g, N, 2] in the activations' dtype.
        zeros = minima + 8.0 * scales
        self.scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
        self.bias = bias
        self.group_size = group_size
        self.kept_rows = None  # as ``Int8Linear.kept_rows``
        if keep_rows:
            first = len(weight) - keep_rows
            sz = self.scales_zeros[:, first:].float()  # [K / g, rows, 2], as the kernel holds them
            rows = q[first:].view(keep_rows, -1, group_size).float() - 8.0
            w = rows * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
            self.kept_rows = w.view(keep_rows, -1).to(weight.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, keep_rows: int = 0):
    """``weight`` [N, K] as an ``Int8Linear`` or ``Int4Linear`` (int4 where K is whole groups; else int8);
    ``keep_rows``: its last rows also kept dequantized at full width (``kept_rows``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if weight.device.type != "cpu":
        raise ValueError("quantization: quantized weights are served on CPU only (no GPU kernel yet)")
    if quantization == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return Int4Linear(weight, bias, keep_rows=keep_rows)
    return Int8Linear(weight, bias, keep_rows=keep_rows)

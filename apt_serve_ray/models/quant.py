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

Speed on this project's CPU (AMD EPYC Zen 5, one thread, bf16 activations; ``benchmarks/quantized_weights.py`` and
``benchmarks/woq_layers.py``, docs/benchmarks.md, issue 43), per layer against the bf16 weight prepacked for oneDNN
(``linear.Linear``), through our kernels (``kernels/csrc/cpu_woq.cpp``, AVX-512 BF16): at one row int8 0.47-0.64x,
int4 0.40-0.58x; at 32 rows int8 1.18-1.33x, int4 1.32-1.54x. From ``WIDEN_ROWS`` rows (a prefill chunk) the
codes are widened into a bf16 scratch and multiplied by oneDNN's GEMM instead: 1.06-1.40x at 512 rows. Where ours do not build, torch's serve (``_weight_int8pack_mm``: 1.9-2.8x at 8-32
rows; ``_weight_int4pack_mm_for_cpu``, faster than ours but with d and m + 8d in bf16: see ``Int4Linear``). In
float32 torch's kernels run 9-170x full width: quantization is refused there (with ``dtype="auto"`` choosing float32
on a CPU without native bf16, the weights are served at full width instead, with a warning). CUDA devices keep
full-width weights. Checkpoints that arrive quantized (GPTQ, AWQ, compressed-tensors) become these layers from
their codes: ``checkpoint_quant.py``.
"""

from __future__ import annotations

import functools
import os

import torch

from apt_serve_ray.config import QUANTIZATIONS
INT4_GROUP = 32  # GGUF Q4_0 / Q4_1's block
# From this many rows (a prefill chunk) our layers widen the weight into a bf16 scratch and multiply it by
# oneDNN's bf16 GEMM (``benchmarks/woq_layers.py``, one thread, SmolLM2's and TinyLlama's layer shapes): at 512 rows
# int4 1.06-1.33x full width against 1.60-1.74x through the kernel, int8 1.07-1.40x against 1.38-1.49x; at 128 rows
# widening wins on SmolLM2's layers (int4 1.20-1.34x against 1.64-1.69x) but not on TinyLlama's (1.61-1.95x against
# 1.57-1.61x; int8 1.89-2.29x against 1.33-1.36x).
WIDEN_ROWS = {"int4": 256, "int8": 512}


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


def natural_order(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """``w`` [N, K] whose inputs are in the order ``perm`` (an act-order checkpoint's) back in their own."""
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


@functools.cache
def native_int8_kernel() -> bool:
    """Whether our int8 kernel (``kernels/csrc/cpu_woq.cpp``: AVX-512 BF16) serves int8 layers here;
    ``APT_SERVE_WOQ_KERNEL=0`` turns it off (torch's ``_weight_int8pack_mm`` then serves, for A/B runs)."""
    if os.environ.get("APT_SERVE_WOQ_KERNEL", "1") == "0":
        return False
    try:
        from apt_serve_ray.kernels import cpu_attention

        cpu_attention.load()
        return bool(torch.ops.apt_serve.woq_native())
    except RuntimeError:
        return False


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (K even) -> [N / 16, K / 2, 16, 2], N padded to 16 with zeros: each 32 bytes are 16
    channels x a pair of inputs, one operand of ``vdpbf16ps`` once converted (``cpu_woq.cpp``)."""
    n, k = q.shape
    npad = -(-n // 16) * 16
    padded = torch.zeros(npad, k, dtype=torch.int8)
    padded[:n] = q
    return padded.view(npad // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class Int8Linear:
    """``y = x (q * scale)^T + b`` with the int8 codes kept packed (1 byte a weight): our kernel where the
    CPU has AVX-512 BF16 and the activations are bf16 (reads each weight block once per 4 rows of x, scale
    and bias applied in float32), torch's ``_weight_int8pack_mm`` elsewhere."""

    __slots__ = ("qweight", "scales", "bias", "kept_rows", "packed", "scale32", "bias32", "out_features")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, *, keep_rows: int = 0,
                 codes: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> None:
        """``weight`` [N, K] quantized here, or ``codes`` (int8 [N, K], float32 scales [N]) as a checkpoint
        stores them, with ``dtype`` the activations'."""
        q, scales = quantize_int8(weight) if codes is None else codes
        dtype = weight.dtype if codes is None else dtype
        self.out_features = len(q)
        self.qweight, self.scales, self.bias = q, scales.to(dtype), bias
        # The last ``keep_rows`` rows as the kernel sees them, at full width (the K/V rows the hidden
        # cache kinds project stored x with: the same weights as the KV path's, so both kinds agree).
        self.kept_rows = self.dequantize()[len(q) - keep_rows:].to(dtype) if keep_rows else None
        self.packed = self.scale32 = self.bias32 = None
        if dtype == torch.bfloat16 and q.shape[1] % 2 == 0 and native_int8_kernel():
            self.packed = pack_int8(q)
            npad = self.packed.shape[0] * 16
            self.scale32 = torch.zeros(npad)
            self.scale32[: len(q)] = scales  # float32, as quantized (not rounded to bf16)
            if bias is not None:
                self.bias32 = torch.zeros(npad)
                self.bias32[: len(q)] = bias.float()
            self.qweight = None  # one copy of the codes

    @property
    def nbytes(self) -> int:
        codes = self.packed if self.packed is not None else self.qweight
        return codes.nbytes + (self.scale32 if self.scale32 is not None else self.scales).nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 [N, K]."""
        if self.qweight is None:  # packed: back to [N, K]
            npad = self.packed.shape[0] * 16
            q = self.packed.permute(0, 2, 1, 3).reshape(npad, -1)[: self.out_features]
            return q.float() * self.scale32[: self.out_features, None]
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if self.packed is not None and len(rows) >= WIDEN_ROWS["int8"] and rows.dtype == torch.bfloat16:
            wt = _scratch(self.packed.shape[1] * 2, self.packed.shape[0] * 16)
            torch.ops.apt_serve.woq_int8_dequant_t(self.packed, self.scale32, wt)
            y = _widened_product(rows, wt, self.bias, self.out_features)
        elif self.packed is not None:  # our layout: bf16 activations (the kernel checks)
            y = torch.ops.apt_serve.woq_int8_linear(rows, self.packed, self.scale32, self.bias32, self.out_features)
        else:
            y = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
            if self.bias is not None:
                y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def pack_int4(q: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 0..15 [N, K] with their groups' d and m [N, K / 32] -> (codes [N / 16, K / 2, 16] uint8, two to a
    byte: of one block's 32 codes for a pair of inputs, code j in byte j's low nibble and code j + 16 in its
    high nibble; (d, m) [N / 16, K / 32, 16, 2] float32), N padded to 16 (``cpu_woq.cpp``)."""
    n, k = q.shape
    npad = -(-n // 16) * 16
    codes = torch.zeros(npad, k, dtype=torch.uint8)
    codes[:n] = q.to(torch.uint8)
    pairs = codes.view(npad // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(npad // 16, k // 2, 32)
    packed = (pairs[..., :16] | (pairs[..., 16:] << 4)).contiguous()
    dm = torch.zeros(npad, k // INT4_GROUP, 2)
    dm[:n, :, 0], dm[:n, :, 1] = scales, minima
    return packed, dm.view(npad // 16, 16, k // INT4_GROUP, 2).permute(0, 2, 1, 3).contiguous()


class Int4Linear:
    """``y = x (d q + m)^T + b`` with 4-bit codes packed two to a byte, groups of ``INT4_GROUP`` inputs: our
    kernel where the CPU has AVX-512 BF16 and the activations are bf16 (d and m in float32, each group's dot
    product folded into a float32 sum: 3/4 of a byte a weight), torch's ``_weight_int4pack_mm_for_cpu``
    elsewhere. Torch's is faster in bf16 at one row (0.63-0.71x the bf16 weight, against ours' 0.67-0.96x) but
    holds d and m + 8d in bf16, its only form, and on the default model's chat template that changed the answer
    from the first token ("What is the capital of France?": "L'Étoile, la Marseur, ..." against full width's
    "The capital of France is Paris."); ours answers as full width does."""

    __slots__ = ("packed", "scales_zeros", "bias", "group_size", "kept_rows", "dm", "bias32", "out_features", "perm")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, *,
                 group_size: int = INT4_GROUP, keep_rows: int = 0,
                 codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None, perm: torch.Tensor | None = None) -> None:
        """``weight`` [N, K] quantized here, or ``codes`` (0..15 [N, K], d and m [N, K / 32] float32) as a
        checkpoint stores them (``checkpoint_quant.py``), with ``dtype`` the activations' and ``perm`` the
        input order of an act-order checkpoint's codes."""
        q, scales, minima = quantize_int4(weight, group_size) if codes is None else codes
        dtype = weight.dtype if codes is None else dtype
        n = len(q)
        self.bias, self.group_size, self.out_features, self.perm = bias, group_size, n, perm
        self.scales_zeros = self.dm = self.bias32 = None
        if dtype == torch.bfloat16 and group_size == INT4_GROUP and native_int8_kernel():
            self.packed, self.dm = pack_int4(q, scales, minima)
            if bias is not None:
                self.bias32 = torch.zeros(self.packed.shape[0] * 16)
                self.bias32[:n] = bias.float()
            reference = dequantize_int4(q, scales, minima, group_size)  # what the kernel multiplies by
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.int(), 1)
            # The kernel's form: w = (q - 8) * scale + zero, [K / g, N, 2] in the activations' dtype.
            zeros = minima + 8.0 * scales
            self.scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
            sz = self.scales_zeros.float()
            reference = ((q.view(n, -1, group_size).float() - 8.0) * sz[..., 0].T[..., None]
                         + sz[..., 1].T[..., None]).view(n, -1)
        reference = natural_order(reference, perm)  # the inputs' own order, for the rows kept at full width
        # As ``Int8Linear.kept_rows``: the last rows as the kernel multiplies by them, at full width.
        self.kept_rows = reference[n - keep_rows:].to(dtype) if keep_rows else None

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.dm if self.dm is not None else self.scales_zeros).nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        rows = rows.index_select(1, self.perm) if self.perm is not None else rows.contiguous()
        if self.dm is not None and len(rows) >= WIDEN_ROWS["int4"] and rows.dtype == torch.bfloat16:
            wt = _scratch(self.packed.shape[1] * 2, self.packed.shape[0] * 16)
            torch.ops.apt_serve.woq_int4_dequant_t(self.packed, self.dm, wt)
            y = _widened_product(rows, wt, self.bias, self.out_features)
        elif self.dm is not None:  # our layout: bf16 activations (the kernel checks)
            y = torch.ops.apt_serve.woq_int4_linear(rows, self.packed, self.dm, self.bias32, self.out_features)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_zeros)
            if self.bias is not None:
                y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


_SCRATCH: list[torch.Tensor] = []  # one bf16 buffer the layers widen into, in turn (a forward pass is one thread)


def _scratch(k: int, npad: int) -> torch.Tensor:
    """A [k, npad] bf16 view of the shared scratch, grown to the largest layer widened so far (kept: allocating
    tens of MB afresh per call faulted in fresh pages, which cost more than the widening on TinyLlama's layers)."""
    if not _SCRATCH or _SCRATCH[0].numel() < k * npad:
        _SCRATCH[:] = [torch.empty(k * npad, dtype=torch.bfloat16)]
    return _SCRATCH[0][: k * npad].view(k, npad)


def _widened_product(rows: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """rows [M, K] @ the widened weight wt [K, Npad] (its values those the kernels multiply by), the first n."""
    y = torch.mm(rows, wt)
    if y.shape[1] != n:
        y = y[:, :n].contiguous()
    if bias is not None:
        y += bias
    return y


def quantized_linear(weight, bias: torch.Tensor | None, quantization: str, keep_rows: int = 0):
    """``weight`` [N, K] as an ``Int8Linear`` or ``Int4Linear`` (int4 where K is whole groups; else int8), or
    a checkpoint's codes (a ``checkpoint_quant.QuantizedWeight``) as the layer of their bit width;
    ``keep_rows``: its last rows also kept dequantized at full width (``kept_rows``)."""
    from apt_serve_ray.models.checkpoint_quant import QuantizedWeight

    if isinstance(weight, QuantizedWeight):
        if weight.bits == 8:
            return Int8Linear(None, bias, keep_rows=keep_rows, codes=(weight.codes, weight.scales), dtype=weight.dtype)
        return Int4Linear(None, bias, keep_rows=keep_rows, codes=(weight.codes, weight.scales, weight.minima),
                          dtype=weight.dtype, perm=weight.perm)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if weight.device.type != "cpu":
        raise ValueError("quantization: quantized weights are served on CPU only (no GPU kernel yet)")
    if quantization == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return Int4Linear(weight, bias, keep_rows=keep_rows)
    return Int8Linear(weight, bias, keep_rows=keep_rows)

"""Checkpoints that arrive quantized (issue 43): GPTQ and AWQ 4-bit, and compressed-tensors (llm-compressor)
int8 (W8A8) and 4-bit (W4A16), read in their packed form and kept as codes for our int4 / int8 layers
(``quant.py``): never widened to full width and quantized again, so the weights served are the checkpoint's.

The formats, per linear layer ``<prefix>`` (N outputs, K inputs, G groups of ``group_size`` inputs)::

    GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"; 4 bits):
        qweight int32 [K/8, N]   q[k, n] = bits 4(k%8).. of qweight[k//8, n]
        qzeros  int32 [G, N/8]   z[g, n] = bits 4(n%8).. of qzeros[g, n//8], stored as zero - 1 ("gptq_v2": zero)
        scales  fp16  [G, N]     g_idx int32 [K]: the group of input k (act-order: not k // group_size)
        w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
    AWQ (AutoAWQ "gemm", zero point; 4 bits):
        qweight int32 [K, N/8], qzeros int32 [G, N/8]: eight values of n per int32, nibble i holding
        n = 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];  scales fp16 [G, N];  w[n, k] = scales[g, n] * (q[k, n] - z[g, n])
    compressed-tensors, format "int-quantized" (W8A8; 8 bits, symmetric, per channel):
        weight int8 [N, K], weight_scale [N, 1];  w = weight_scale * weight
    compressed-tensors, format "pack-quantized" (W4A16; 4 bits, symmetric, groups or channel):
        weight_packed int32 [N, K/8]: q + 8 in bits 4(k%8).. ;  weight_scale [N, G];  w = weight_scale * q

Activations stay in the model's dtype: a W8A8 checkpoint's int8 activations are not applied (bf16 activations
are nearer the full-width model than the checkpoint's own scheme). A 4-bit layer becomes ``w = d q + m`` per
group of 32 inputs (d = scale, m = -scale * zero, each checkpoint group's pair repeated over its 32-input
pieces); an act-order layer keeps its inputs sorted by group and permutes x to match (``QuantizedWeight.perm``).
"""

from __future__ import annotations

import logging

import torch

from apt_serve_ray.models.quant import INT4_GROUP, dequantize_int4, natural_order

logger = logging.getLogger("apt_serve_ray")

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]


class QuantizedWeight:
    """A linear layer's weight as codes: 4 bits (``codes`` uint8 0..15 [N, K], ``scales`` d and ``minima`` m
    [N, K / 32] float32: w = d q + m) or 8 bits (``codes`` int8 [N, K], ``scales`` [N] float32: w = q scale);
    ``perm``: for an act-order layer, the input order the codes are in (x[:, perm] multiplies them).
    ``dtype``: the activations' dtype the model asks for (``to``)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None, method: str = "") -> None:
        self.codes, self.scales, self.minima, self.perm, self.method = codes, scales, minima, perm, method
        self.dtype = torch.bfloat16

    @property
    def bits(self) -> int:
        return 8 if self.minima is None else 4

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __len__(self) -> int:
        return len(self.codes)

    def to(self, device=None, dtype=None) -> QuantizedWeight:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"quantization: {self.method} checkpoints are served on CPU only (no GPU kernel yet)")
        if dtype is not None:
            self.dtype = dtype
        return self

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for, float32 [N, K], inputs in their natural order."""
        if self.bits == 8:
            return self.codes.float() * self.scales[:, None]
        return natural_order(dequantize_int4(self.codes, self.scales, self.minima), self.perm)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Projections fused along the outputs (q | k | v, gate | up): one layer of codes."""
        first = parts[0]
        if any(p.bits != first.bits for p in parts):
            raise ValueError("checkpoint: fused projections are quantized with different bit widths")
        perms = [p.perm for p in parts]
        if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms):
            raise ValueError("checkpoint: fused projections (q/k/v or gate/up) have different act-order input "
                             "orders (g_idx); such a checkpoint is not served")
        minima = None if first.minima is None else torch.cat([p.minima for p in parts])
        out = QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), minima,
                              first.perm, first.method)
        out.dtype = first.dtype
        return out


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values along the rows -> [8R, C] (value j of row r: bits 4j..)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values along the columns -> [R, 8C]; nibble i holds column 8c + order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, C, 8] by nibble
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)


def _int4_codes(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_of: torch.Tensor,
                method: str, name: str) -> QuantizedWeight:
    """q [N, K] 0..15, zeros / scales [G, N] per checkpoint group, ``group_of`` [K]: the group of each input ->
    our layout (inputs sorted by group where they are not already; d and m per 32 inputs)."""
    n, k = q.shape
    if k % INT4_GROUP:
        raise ValueError(f"checkpoint: {name} has {k} inputs, not whole groups of {INT4_GROUP}")
    perm = None
    if bool((group_of[1:] < group_of[:-1]).any()):  # act-order: inputs sorted by group, x permuted to match
        perm = torch.argsort(group_of, stable=True)
        q, group_of = q[:, perm], group_of[perm]
    pieces = group_of.view(-1, INT4_GROUP)
    if bool((pieces != pieces[:, :1]).any()):
        raise ValueError(f"checkpoint: {name}'s groups are not whole multiples of {INT4_GROUP} inputs "
                         "(group_size must be a multiple of 32)")
    g = pieces[:, 0].long()  # [K / 32]: the checkpoint group of each of our groups
    d = scales.float()[g].T.contiguous()  # [N, K / 32]
    m = (-scales.float() * zeros.float())[g].T.contiguous()
    return QuantizedWeight(q.contiguous(), d, m, perm, method)


def _gptq(state: dict, prefix: str, qconfig: dict) -> QuantizedWeight:
    bits = qconfig.get("bits", 4)
    if bits != 4:
        raise ValueError(f"quantization: {bits}-bit GPTQ is not served (4 bits only)")
    qweight, qzeros, scales = (state.pop(prefix + s) for s in ("qweight", "qzeros", "scales"))
    g_idx = state.pop(prefix + "g_idx", None)
    q = _unpack_rows(qweight).T  # [N, K]
    k = q.shape[1]
    zeros = _unpack_cols(qzeros).int()
    if qconfig.get("checkpoint_format", "gptq") != "gptq_v2":
        zeros = zeros + 1  # AutoGPTQ stores zero - 1
    if g_idx is None:
        group = qconfig.get("group_size", 128)
        g_idx = torch.arange(k, dtype=torch.int32) // (k if group in (-1, None) else group)
    return _int4_codes(q, zeros, scales, g_idx.long(), "gptq", prefix)


def _awq(state: dict, prefix: str, qconfig: dict) -> QuantizedWeight:
    bits = qconfig.get("bits", qconfig.get("w_bit", 4))
    version = str(qconfig.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or qconfig.get("zero_point", True) is False:
        raise ValueError(f"quantization: AWQ {version} with {bits} bits and zero_point="
                         f"{qconfig.get('zero_point', True)} is not served (4-bit GEMM with zero points only)")
    qweight, qzeros, scales = (state.pop(prefix + s) for s in ("qweight", "qzeros", "scales"))
    q = _unpack_cols(qweight, AWQ_ORDER).T  # [N, K]
    zeros = _unpack_cols(qzeros, AWQ_ORDER).int()
    k = q.shape[1]
    group = qconfig.get("group_size", qconfig.get("q_group_size", 128))
    g_idx = torch.arange(k) // (k if group in (-1, None) else group)
    return _int4_codes(q, zeros, scales, g_idx, "awq", prefix)


def _compressed(state: dict, prefix: str, qconfig: dict) -> QuantizedWeight:
    fmt = qconfig.get("format")
    scheme = _weight_scheme(qconfig)
    if not scheme.get("symmetric", True) or prefix + "weight_zero_point" in state and bool(
            state[prefix + "weight_zero_point"].any()):
        raise ValueError("quantization: asymmetric compressed-tensors weights are not served (symmetric only)")
    scale = state.pop(prefix + "weight_scale").float()
    state.pop(prefix + "weight_zero_point", None)
    state.pop(prefix + "input_scale", None)  # static activation scales: activations stay at full width here
    if fmt in ("int-quantized", "naive-quantized") and scheme.get("num_bits", 8) == 8:
        if scheme.get("strategy", "channel") not in ("channel", "tensor"):
            raise ValueError(f"quantization: int8 weights with strategy {scheme.get('strategy')!r} are not served "
                             "(per channel or per tensor)")
        weight = state.pop(prefix + "weight")
        return QuantizedWeight(weight.to(torch.int8), scale.flatten().expand(len(weight)).contiguous(),
                               method="compressed-tensors")
    if fmt == "pack-quantized" and scheme.get("num_bits") == 4:
        packed = state.pop(prefix + "weight_packed")
        shape = state.pop(prefix + "weight_shape", None)
        q = _unpack_cols(packed)  # [N, K'] (values along the inputs)
        n, k = (int(s) for s in shape) if shape is not None else q.shape
        q = q[:, :k]
        group = k // scale.shape[1]
        g_idx = torch.arange(k) // group
        zeros = torch.full((scale.shape[1], n), 8)
        return _int4_codes(q, zeros, scale.T, g_idx, "compressed-tensors", prefix)
    raise ValueError(f"quantization: compressed-tensors format {fmt!r} with {scheme.get('num_bits')}-bit weights is "
                     "not served (int-quantized 8-bit, pack-quantized 4-bit)")


def _weight_scheme(qconfig: dict) -> dict:
    groups = list((qconfig.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"quantization: compressed-tensors with {len(groups)} config groups is not served (one)")
    return groups[0].get("weights") or {}


_READERS = {"gptq": (_gptq, "qweight"), "awq": (_awq, "qweight"), "compressed-tensors": (_compressed, None)}


def checkpoint_method(qconfig: dict | None) -> str | None:
    """The quantization a checkpoint's ``quantization_config`` names (one we serve), else None."""
    if not qconfig:
        return None
    method = qconfig.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization: checkpoints quantized with {method!r} are not served; "
                         f"served: {', '.join(CHECKPOINT_METHODS)}")
    return method


def read_quantized(state: dict, qconfig: dict) -> dict:
    """``state`` with every quantized linear layer's tensors replaced by ``<prefix>weight``: a QuantizedWeight."""
    method = checkpoint_method(qconfig)
    reader, marker = _READERS[method]
    if marker is None:  # compressed-tensors: the layers with a weight_scale
        prefixes = [k[: -len("weight_scale")] for k in state if k.endswith(".weight_scale")]
    else:
        prefixes = [k[: -len(marker)] for k in state if k.endswith("." + marker)]
    for prefix in prefixes:
        state[prefix + "weight"] = reader(state, prefix, qconfig)
    return state


def dequantize_state(state: dict, dtype: torch.dtype) -> dict:
    """Every QuantizedWeight widened to ``dtype`` (where the kernels for codes do not run: float32, GPU)."""
    return {k: (v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) else v) for k, v in state.items()}


def has_quantized(state: dict) -> str | None:
    """The method of the first QuantizedWeight in ``state``, or None."""
    return next((v.method for v in state.values() if isinstance(v, QuantizedWeight)), None)


def checked_quantization(config, state: dict, dtype: torch.dtype, device) -> str | None:
    """What the model is built with: ``config.quantization`` for a full-width checkpoint, the checkpoint's
    own method for a quantized one (refusing a contradiction, naming the field), or None where its codes
    are widened to full width (float32 activations or a GPU: no kernel of ours runs there; a warning says so)."""
    method = has_quantized(state)
    asked = config.quantization
    if method is None:
        if asked in CHECKPOINT_METHODS:
            raise ValueError(f"quantization: {asked!r} reads a checkpoint quantized with it; {config.model!r} is not")
        return asked
    if asked is not None and asked != method:
        raise ValueError(f"quantization: {config.model!r} is already quantized ({method}); leave quantization "
                         f"unset or set it to {method!r}, not {asked!r}")
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        logger.warning("%s checkpoint: its weights are widened to %s on %s (the kernels for its codes run with "
                       "bfloat16 activations on CPU)", method, dtype, device)
        return None
    return method

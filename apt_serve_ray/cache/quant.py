"""INT8 cache quantisation: the reference every kernel that reads or writes int8 pages matches.

Symmetric, per token and group: ``s = max|x| / 127`` over each group of ``group`` consecutive elements
(a head's K or V, or ``quant_group`` elements of x), ``q = round(x / s)`` clamped to [-127, 127]; an
all-zero group gets ``s = 0`` and ``q = 0``. ``x ~= q * s`` with error at most ``s / 2`` per element.
Computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., E] -> (q int8 [..., E], scales float32 [..., E // group])."""
    if x.shape[-1] % group:
        raise ValueError(f"group: {group} does not divide the last dimension {x.shape[-1]}")
    xg = x.float().unflatten(-1, (x.shape[-1] // group, group))
    scale = xg.abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xg * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [..., E], scales [..., E // group]) -> x [..., E] in ``dtype``."""
    x = q.float().unflatten(-1, (q.shape[-1] // group, group)) * scale.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)

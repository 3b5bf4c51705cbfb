"""Rotary position embedding (HF "rotate_half" convention), cos/sin tabled once per model.

The inverse frequencies come from transformers' own rope init functions, so every rope type a
checkpoint declares (default, linear, llama3, yarn, ...) gets the same numbers as the reference.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding:
    """cos/sin tables for the first ``rotary_dim`` dims of each head (all of them but where the config
    sets ``partial_rotary_factor``, as Phi-3's variants may); the other dims pass through unrotated."""

    def __init__(self, config, head_dim: int, max_positions: int, device, dtype: torch.dtype,
                 layer_type: str | None = None) -> None:
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        if layer_type is not None:  # one set per kind of layer (Gemma 3: local and global attention)
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor: {factor} of head_dim {head_dim} is not an even number of dims")
        if rope_type == "default":
            base, dim = params["rope_theta"], self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_parameters.rope_type: unsupported rope type {rope_type!r}")
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", **kwargs)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., n, heads, head_dim] with positions broadcastable to [..., n]."""
        cos = self.cos[positions].unsqueeze(-2)
        sin = self.sin[positions].unsqueeze(-2)
        if self.is_partial:
            rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            half = self.rotary_dim // 2
            rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
            return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

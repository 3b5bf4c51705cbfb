"""Rotary position embedding (HF "rotate_half" convention), cos/sin tabled once per model.

The inverse frequencies come from transformers' own rope init functions, so every rope type a
checkpoint declares (default, linear, llama3, yarn, ...) gets the same numbers as the reference.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding:
    def __init__(self, config, head_dim: int, max_positions: int, device, dtype: torch.dtype) -> None:
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_parameters.rope_type: unsupported rope type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., n, heads, head_dim] with positions broadcastable to [..., n]."""
        cos = self.cos[positions].unsqueeze(-2)
        sin = self.sin[positions].unsqueeze(-2)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

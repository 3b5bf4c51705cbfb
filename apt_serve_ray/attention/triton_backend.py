"""CUDA backend: Triton kernels read KV pages in place and fuse the hidden kind's K/V projection into
the attention loop (``kernels/paged_kv_attention.py``, ``kernels/hidden_attention.py``); prefill
chunks share the PyTorch path. On CPU it runs only under ``TRITON_INTERPRET=1`` (tests)."""

from __future__ import annotations

import torch

from apt_serve_ray.attention.backend import AttentionBackend
from apt_serve_ray.attention.metadata import DecodeGroup, KVProjection
from apt_serve_ray.cache.storage import CacheStorage


def fused_hidden_supports(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


class TritonBackend(AttentionBackend):
    name = "triton"
    has_fused_hidden = True

    def __init__(self, fused_hidden: bool = True) -> None:
        import triton  # noqa: F401  (ImportError: the registry says which backends exist)

        super().__init__(fused_hidden)

    def describe(self) -> str:
        return f"triton (paged KV decode; hidden decode {'fused' if self.fused_hidden else 'unfused'})"

    def decode_kv(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        from apt_serve_ray.kernels.paged_kv_attention import paged_kv_decode

        return paged_kv_decode(q, storage.kv[layer], g.block_table, g.ctx_lens, scale)

    def decode_hidden(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                      scale: float) -> torch.Tensor:
        if not (self.fused_hidden and proj.fusable and fused_hidden_supports(proj.head_dim)):
            return super().decode_hidden(layer, q, g, storage, proj, scale)
        from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention

        cos, sin = (proj.rotary.cos, proj.rotary.sin) if proj.has_rope else (None, None)
        return hidden_decode_attention(q, storage.hidden[layer], g.block_table, g.ctx_lens, proj.w_kv, proj.b_kv,
                                       cos, sin, proj.num_kv_heads, scale)

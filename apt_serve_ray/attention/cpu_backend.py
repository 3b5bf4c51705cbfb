"""CPU backend: decode rows read their pages in place through the C++ kernels
(``kernels/cpu_attention.py``); prefill chunks share the PyTorch path (see ``backend.py``)."""

from __future__ import annotations

import torch

from apt_serve_ray.attention.backend import AttentionBackend
from apt_serve_ray.attention.metadata import DecodeGroup, KVProjection
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.kernels import cpu_attention


class CpuBackend(AttentionBackend):
    name = "cpu"
    has_fused_hidden = True

    def __init__(self, fused_hidden: bool = True) -> None:
        cpu_attention.load()  # build or load now: a missing compiler is a start-up error, not a step error
        super().__init__(fused_hidden)

    def describe(self) -> str:
        how = "fused (no RoPE: W_k absorbed into q; RoPE: K/V projected per page)" if self.fused_hidden else \
            "unfused: gather x, project K/V"
        return f"cpu (C++ paged attention; hidden decode {how})"

    def decode_kv(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        return cpu_attention.kv_decode(q, storage.kv[layer], g.block_table, g.ctx_lens, scale)

    def decode_hidden(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                      scale: float) -> torch.Tensor:
        if not self.fused_hidden:
            return super().decode_hidden(layer, q, g, storage, proj, scale)
        hidden = storage.hidden[layer]
        if proj.has_rope:
            return cpu_attention.hidden_decode_projected(q, hidden, g.block_table, g.ctx_lens, proj.w_kv.t(),
                                                         proj.b_kv, proj.rotary.cos, proj.rotary.sin,
                                                         proj.num_kv_heads, scale)
        return cpu_attention.hidden_decode_absorbed(q, hidden, g.block_table, g.ctx_lens, proj.w_kv, proj.b_kv,
                                                    proj.num_kv_heads, scale)

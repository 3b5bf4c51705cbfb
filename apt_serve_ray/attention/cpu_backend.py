"""CPU backend: C++ kernels (``kernels/cpu_attention.py``) for decode rows, which read their pages
in place (the int8 kinds too: dequantised in registers or per page in a thread-local tile), and for
prefill chunks (AVX-512 builds): KV chunks attend over their pages in place, hidden chunks over the
K/V projected from their stored x, int8 chunks over their context dequantised into one contiguous
tile (their own tokens included, as the reference does). Elsewhere prefill takes the PyTorch path.

Measured (OPT-125m shape, one thread, causal 384-token chunk per layer): bf16 2.7 ms vs SDPA 5.6 ms;
512 queries over 1,024 keys 13.6 vs 21.1 ms; float32 1.0-1.4x SDPA's speed."""

from __future__ import annotations

import torch

from apt_serve_ray.attention.backend import AttentionBackend, read_kv
from apt_serve_ray.attention.metadata import DecodeGroup, KVProjection, PrefillChunk
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.kernels import cpu_attention
from apt_serve_ray.request import CacheKind


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

    def prefill(self, layer: int, q, k, v, c: PrefillChunk, storage: CacheStorage, proj: KVProjection,
                scale: float) -> torch.Tensor:
        if not cpu_attention.prefill_supported(q.shape[-1], q.dtype):
            return super().prefill(layer, q, k, v, c, storage, proj, scale)
        if c.kind is CacheKind.KV:
            kv = storage.kv[layer]
            return cpu_attention.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], c.block_table, c.start_pos, scale)
        ctx = c.start_pos + c.num_tokens
        if c.start_pos == 0 and not c.kind.is_int8:
            keys, values = k, v
        else:  # hidden: project the stored x; int8 kinds: dequantise (their own tokens too, as the reference)
            keys, values = read_kv(layer, storage, c.kind, c.pages, c.offsets, proj,
                                   torch.arange(ctx, device=q.device), q.dtype)
        table = torch.arange(ctx, dtype=torch.int32, device=q.device)  # one token per "page"
        return cpu_attention.prefill_attention(q, keys[:, None], values[:, None], table, c.start_pos, scale)

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

    def decode_kv_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        return cpu_attention.kv_int8_decode(q, storage.kv_int8[layer], storage.kv_int8_scale[layer], g.block_table,
                                            g.ctx_lens, scale)

    def decode_hidden_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                           scale: float) -> torch.Tensor:
        if not self.fused_hidden:
            return super().decode_hidden_int8(layer, q, g, storage, proj, scale)
        hidden, scales = storage.hidden_int8[layer], storage.hidden_int8_scale[layer]
        if proj.has_rope:
            return cpu_attention.hidden_int8_decode_projected(q, hidden, scales, g.block_table, g.ctx_lens,
                                                              proj.w_kv.t(), proj.b_kv, proj.rotary.cos,
                                                              proj.rotary.sin, proj.num_kv_heads, scale)
        return cpu_attention.hidden_int8_decode_absorbed(q, hidden, scales, g.block_table, g.ctx_lens, proj.w_kv,
                                                         proj.b_kv, proj.num_kv_heads, scale)

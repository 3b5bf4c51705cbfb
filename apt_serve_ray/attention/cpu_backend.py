"""CPU backend: C++ kernels (``kernels/cpu_attention.py``) for decode rows, which read their pages
in place (the int8 kinds too: dequantised in registers or per page in a thread-local tile); prefill
chunks attend over their context (KV pages read in place; hidden chunks over the K/V projected from
their stored x; int8 chunks over their context dequantised into one tile, their own tokens included,
as the reference does) through whichever of two paths is faster on this CPU:

* ``kernel``: the C++ prefill kernel (AVX-512 builds only), four query rows at a time over keys packed
  16 to an instruction;
* ``sdpa``: the context's K/V gathered page by page into one tile, then torch's fused CPU attention
  (blocked GEMMs through oneDNN: AMX on CPUs that have it).

Which one is timed once per process and shape (``prefill_path``: 128 queries over 1,024 keys of this
model's heads and dtype; the faster one wins), since the answer differs by CPU: on a Xeon with AMX
(2026-12-03, one thread, OPT-125m layer, 512 queries at position 1,000) the kernel took 67.0 ms
float32 / 40.4 ms bf16 against SDPA's 27.9 / 11.4 ms, which made a step with such a chunk 1.75x one
with the chunk at position 0; on a Zen 5 the kernel was 1.0-1.4x faster than SDPA. ``prefill=`` forces one."""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from apt_serve_ray.attention.backend import AttentionBackend, read_context_kv
from apt_serve_ray.attention.metadata import DecodeGroup, KVProjection, PrefillChunk
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.kernels import cpu_attention
from apt_serve_ray.request import CacheKind

logger = logging.getLogger("apt_serve_ray")


PREFILL_PATHS = ("auto", "kernel", "sdpa")


class CpuBackend(AttentionBackend):
    name = "cpu"
    has_fused_hidden = True

    def __init__(self, fused_hidden: bool = True, prefill: str = "auto") -> None:
        cpu_attention.load()  # build or load now: a missing compiler is a start-up error, not a step error
        if prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill: must be one of {PREFILL_PATHS}, got {prefill!r}")
        super().__init__(fused_hidden)
        self.prefill_choice = prefill

    def describe(self) -> str:
        how = "fused (no RoPE: W_k absorbed into q; RoPE: K/V projected per page)" if self.fused_hidden else \
            "unfused: gather x, project K/V"
        return f"cpu (C++ paged attention; hidden decode {how}; prefill: {self.prefill_choice})"

    def _path(self, q: torch.Tensor, num_kv_heads: int) -> str:
        heads, dim = q.shape[1], q.shape[2]
        kernel_ok = cpu_attention.prefill_supported(dim, q.dtype)
        if self.prefill_choice == "sdpa" or not kernel_ok:
            return "sdpa"
        if self.prefill_choice == "kernel":
            return "kernel"
        return prefill_path(q.dtype, heads, num_kv_heads, dim)

    def prefill(self, layer: int, q, k, v, c: PrefillChunk, storage: CacheStorage, proj: KVProjection,
                scale: float) -> torch.Tensor:
        path = self._path(q, k.shape[1])
        ctx = c.start_pos + c.num_tokens
        if not (c.kind.stores_hidden or c.kind.is_int8) and c.start_pos > 0 and c.segments is None:
            kv = storage.kv[layer]
            if path == "kernel":  # reads the pages in place
                return cpu_attention.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], c.block_table, c.start_pos, scale)
            keys, values = gather_kv_pages(kv, c.block_table, ctx)
        elif c.start_pos == 0 and not c.kind.is_int8 and c.segments is None:
            keys, values = k, v
        else:  # hidden: project the stored x; int8 kinds: dequantise (their own tokens too, as the reference)
            keys, values = read_context_kv(layer, storage, c, proj, q.dtype)
        if path == "kernel":
            table = torch.arange(ctx, dtype=torch.int32, device=q.device)  # one token per "page"
            return cpu_attention.prefill_attention(q, keys[:, None], values[:, None], table, c.start_pos, scale)
        return sdpa_prefill(q, keys, values, c.start_pos, scale)

    def decode_kv(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        return cpu_attention.kv_decode(q, storage.kv[layer], g.block_table, g.ctx_lens, scale)

    def decode_hidden(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                      scale: float) -> torch.Tensor:
        if not (self.fused_hidden and proj.fusable):
            return super().decode_hidden(layer, q, g, storage, proj, scale)
        hidden = storage.hidden[layer]
        if proj.has_rope:
            return cpu_attention.hidden_decode_projected(q, hidden, g.block_table, g.ctx_lens, proj.w_kv.t(),
                                                         proj.b_kv, proj.rotary.cos, proj.rotary.sin,
                                                         proj.num_kv_heads, scale)
        return cpu_attention.hidden_decode_absorbed(q, hidden, g.block_table, g.ctx_lens, proj.w_kv, proj.b_kv,
                                                    proj.num_kv_heads, scale)

    def decode_lse(self, layer: int, q, kind: CacheKind, g: DecodeGroup, storage: CacheStorage, scale: float):
        if not kind.stores_hidden and not kind.is_int8:
            return cpu_attention.kv_decode_lse(q, storage.kv[layer], g.block_table, g.ctx_lens, scale)
        if not kind.stores_hidden:
            return cpu_attention.kv_int8_decode_lse(q, storage.kv_int8[layer], storage.kv_int8_scale[layer],
                                                    g.block_table, g.ctx_lens, scale)
        return super().decode_lse(layer, q, kind, g, storage, scale)

    def decode_kv_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        return cpu_attention.kv_int8_decode(q, storage.kv_int8[layer], storage.kv_int8_scale[layer], g.block_table,
                                            g.ctx_lens, scale)

    def decode_hidden_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                           scale: float) -> torch.Tensor:
        if not (self.fused_hidden and proj.fusable):
            return super().decode_hidden_int8(layer, q, g, storage, proj, scale)
        hidden, scales = storage.hidden_int8[layer], storage.hidden_int8_scale[layer]
        if proj.has_rope:
            return cpu_attention.hidden_int8_decode_projected(q, hidden, scales, g.block_table, g.ctx_lens,
                                                              proj.w_kv.t(), proj.b_kv, proj.rotary.cos,
                                                              proj.rotary.sin, proj.num_kv_heads, scale)
        return cpu_attention.hidden_int8_decode_absorbed(q, hidden, scales, g.block_table, g.ctx_lens, proj.w_kv,
                                                         proj.b_kv, proj.num_kv_heads, scale)


# Prefill through torch's fused attention ---------------------------------------------------------
def gather_kv_pages(kv: torch.Tensor, block_table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [ctx, KVH, D] of the first ``ctx`` tokens in the pages of ``block_table``, one copy of
    whole pages (``kv``: a layer's [P, BS, 2, KVH, D] view)."""
    bs = kv.shape[1]
    pages = kv.index_select(0, block_table[: (ctx + bs - 1) // bs].long())  # [n, BS, 2, KVH, D]
    flat = pages.flatten(0, 1)[:ctx]
    return flat[:, 0], flat[:, 1]


def sdpa_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of the chunk ``q`` [n, H, D] (query i at ``start_pos + i``) over ``keys`` /
    ``values`` [start_pos + n, KVH, D], through ``F.scaled_dot_product_attention``."""
    n, heads = q.shape[0], q.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = keys.transpose(0, 1).unsqueeze(0)
    vh = values.transpose(0, 1).unsqueeze(0)
    gqa = heads != keys.shape[1]
    if start_pos == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        ctx = start_pos + n
        qpos = torch.arange(start_pos, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


@functools.cache
def prefill_path(dtype: torch.dtype, heads: int, num_kv_heads: int, dim: int, queries: int = 128,
                 keys: int = 1024) -> str:
    """"kernel" or "sdpa": the faster prefill path for this CPU and shape, timed once per process on
    ``queries`` queries at position ``keys - queries`` (fastest of three each, interleaved)."""
    if not cpu_attention.prefill_supported(dim, dtype):
        return "sdpa"
    g = torch.Generator().manual_seed(0)
    bs = 16
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    kv = torch.randn(keys // bs, bs, 2, num_kv_heads, dim, generator=g).to(dtype)
    table = torch.arange(keys // bs, dtype=torch.int32)
    start, scale = keys - queries, dim ** -0.5

    def kernel():
        cpu_attention.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], table, start, scale)

    def sdpa():
        k, v = gather_kv_pages(kv, table, keys)
        sdpa_prefill(q, k, v, start, scale)

    best = {"kernel": float("inf"), "sdpa": float("inf")}
    for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
        try:
            fn()  # warm-up, and whether it runs at all
        except RuntimeError as exc:  # this path cannot run the shape here: the other one
            other = "sdpa" if name == "kernel" else "kernel"
            logger.warning("prefill path %s failed (%s); using %s", name, exc, other)
            return other
    for _ in range(3):
        for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    choice = min(best, key=best.get)
    logger.info("CPU prefill attention: %s (kernel %.2f ms, sdpa %.2f ms for %d queries over %d keys, %s)",
                choice, best["kernel"] * 1e3, best["sdpa"] * 1e3, queries, keys, dtype)
    return choice

"""Attention over the paged hybrid cache (PyTorch path; runs on CPU and CUDA).

Per layer, for the flat batch of this step's tokens:

1. write: KV requests store this step's rotated K and V, hidden requests store only x;
2. decode rows (one query token), batched by kind: KV rows gather K/V from their pages; hidden
   rows gather their stored x and project K/V for the whole context in one matrix product
   (RoPE at the original positions), then one padded SDPA per kind;
3. prefill chunks, one SDPA each: a chunk starting at position 0 attends over its fresh K/V, a
   later chunk gathers its whole context from the cache (of its own kind).

Every request reads only its own pages in its own kind, so mixed batches are exact for both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from apt_serve_ray.cache.storage import CacheStorage

# (x [..., n, hidden], positions [..., n]) -> (k, v) each [..., n, kv_heads, head_dim], k rotated.
KVProjector = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SlotWrite:
    rows: torch.Tensor  # rows of this step's flat token batch
    pages: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor  # page * tokens_per_page + offset


@dataclass
class DecodeGroup:
    """Decode rows of one kind, gathered as a padded batch ``[B, L]`` of cache slots."""

    rows: torch.Tensor  # [B]
    pages: torch.Tensor  # [B, L]
    offsets: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [L]
    add_mask: torch.Tensor  # [B, 1, 1, L] float32: 0 = attend, -inf = padding
    block_table: torch.Tensor | None = None  # [B, max pages] int32, for the fused kernel
    ctx_lens: torch.Tensor | None = None  # [B] int32
    slots: torch.Tensor | None = None  # [B * L] page * tokens_per_page + offset
    kv_index: torch.Tensor | None = None  # KV only: rows of ``kv_head_rows`` in [2, B, KVH, L] order


@dataclass
class PrefillChunk:
    row_start: int
    num_tokens: int
    start_pos: int  # position of the chunk's first token
    is_hidden: bool
    pages: torch.Tensor | None = None  # [ctx] page of each context slot, only when start_pos > 0
    offsets: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    storage: CacheStorage
    num_tokens: int
    use_hidden_kernel: bool = False  # fused Triton hidden decode (CUDA, or forced for tests)
    kv_write: SlotWrite | None = None
    hidden_write: SlotWrite | None = None
    decode_kv: DecodeGroup | None = None
    decode_hidden: DecodeGroup | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    layer: int,
    q: torch.Tensor,  # [T, H, D], rotated
    k: torch.Tensor,  # [T, KVH, D], rotated
    v: torch.Tensor,  # [T, KVH, D]
    x: torch.Tensor,  # [T, hidden]: the input of the K/V projection
    project_kv: KVProjector,
    meta: AttentionMetadata,
    scale: float,
    hidden_params: tuple | None = None,  # (w_kv, b_kv, cos, sin) for the fused kernel
) -> torch.Tensor:
    storage = meta.storage
    kv_cache = storage.kv[layer]
    hidden_cache = storage.hidden[layer]
    gqa = q.shape[1] != k.shape[1]
    if meta.kv_write is not None:
        w = meta.kv_write
        kv_new = torch.stack((k[w.rows], v[w.rows]), dim=1).flatten(1)
        storage.kv_token_rows[layer].index_copy_(0, w.slots, kv_new)
    if meta.hidden_write is not None:
        w = meta.hidden_write
        if storage.hidden_rows is not None:
            storage.hidden_rows[layer].index_copy_(0, w.slots, x[w.rows])
        else:
            hidden_cache[w.pages, w.offsets] = x[w.rows]

    out = torch.empty_like(q)
    if meta.decode_kv is not None:
        g = meta.decode_kv
        batch, length = g.pages.shape
        kvh, dim = k.shape[1], k.shape[2]
        # One gather of head_dim rows straight into contiguous [2, B, KVH, L, D].
        kv = torch.index_select(storage.kv_head_rows[layer], 0, g.kv_index,
                                out=storage.workspace("decode_kv", (g.kv_index.numel(), dim), kv_cache.dtype))
        kv = kv.view(2, batch, kvh, length, dim)
        out[g.rows] = _decode_attend(q[g.rows], kv[0], kv[1], g.add_mask, scale)
    if meta.decode_hidden is not None and meta.use_hidden_kernel and hidden_params is not None:
        from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention

        g = meta.decode_hidden
        w_kv, b_kv, cos, sin = hidden_params
        out[g.rows] = hidden_decode_attention(q[g.rows].contiguous(), hidden_cache, g.block_table, g.ctx_lens,
                                              w_kv, b_kv, cos, sin, k.shape[1], scale)
    elif meta.decode_hidden is not None:
        g = meta.decode_hidden
        batch, length = g.pages.shape
        if storage.hidden_rows is not None:
            hid = hidden_cache.shape[-1]
            xs = torch.index_select(storage.hidden_rows[layer], 0, g.slots,
                                    out=storage.workspace("decode_x", (g.slots.numel(), hid), hidden_cache.dtype))
            xs = xs.view(batch, length, hid)
        else:
            xs = hidden_cache[g.pages, g.offsets]
        keys, values = project_kv(xs, g.positions)  # [B, L, KVH, D]
        kvh, dim = keys.shape[-2:]
        kv = storage.workspace("decode_hidden_kv", (2, batch, kvh, length, dim), keys.dtype)
        kv[0].copy_(keys.transpose(1, 2))
        kv[1].copy_(values.transpose(1, 2))
        out[g.rows] = _decode_attend(q[g.rows], kv[0], kv[1], g.add_mask, scale)
    for c in meta.prefills:
        s, e = c.row_start, c.row_start + c.num_tokens
        qc = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.start_pos == 0:
            keys, values = k[s:e], v[s:e]
            mask, causal = None, True
        else:
            if c.is_hidden:
                ctx = c.start_pos + c.num_tokens
                positions = torch.arange(ctx, device=q.device)
                keys, values = project_kv(hidden_cache[c.pages, c.offsets], positions)
            else:
                kv = kv_cache[c.pages, c.offsets]
                keys, values = kv[:, 0], kv[:, 1]
            mask, causal = _chunk_mask(c, q.device), False
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def _decode_attend(q, keys, values, add_mask, scale: float) -> torch.Tensor:
    """One query token per request over contiguous K/V [B, KVH, L, D]; query heads grouped per KV
    head, so grouped-query attention needs no repeated K/V. Plain batched matmuls: on CPU they beat
    the fused SDPA kernel several times for single-token queries."""
    batch, heads, dim = q.shape
    kvh = keys.shape[1]
    qg = q.view(batch, kvh, heads // kvh, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale).add_(add_mask)  # [B, KVH, G, L]
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).view(batch, heads, dim)


def _chunk_mask(c: PrefillChunk, device) -> torch.Tensor:
    """Query i sits at position start_pos + i and sees keys 0..start_pos + i."""
    ctx = c.start_pos + c.num_tokens
    qpos = torch.arange(c.start_pos, ctx, device=device)[:, None]
    return torch.arange(ctx, device=device)[None, :] <= qpos

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


@dataclass
class DecodeGroup:
    """Decode rows of one kind, gathered as a padded batch ``[B, L]`` of cache slots."""

    rows: torch.Tensor  # [B]
    pages: torch.Tensor  # [B, L]
    offsets: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [L]
    mask: torch.Tensor  # [B, 1, 1, L] True = attend
    block_table: torch.Tensor | None = None  # [B, max pages] int32, for the fused kernel
    ctx_lens: torch.Tensor | None = None  # [B] int32


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
    kv_cache = meta.storage.kv[layer]
    hidden_cache = meta.storage.hidden[layer]
    gqa = q.shape[1] != k.shape[1]
    if meta.kv_write is not None:
        w = meta.kv_write
        kv_cache[w.pages, w.offsets] = torch.stack((k[w.rows], v[w.rows]), dim=1)
    if meta.hidden_write is not None:
        w = meta.hidden_write
        hidden_cache[w.pages, w.offsets] = x[w.rows]

    out = torch.empty_like(q)
    if meta.decode_kv is not None:
        g = meta.decode_kv
        kv = kv_cache[g.pages, g.offsets]  # [B, L, 2, KVH, D]
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        o = F.scaled_dot_product_attention(q[g.rows].unsqueeze(2), keys, values, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out[g.rows] = o.squeeze(2)
    if meta.decode_hidden is not None and meta.use_hidden_kernel and hidden_params is not None:
        from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention

        g = meta.decode_hidden
        w_kv, b_kv, cos, sin = hidden_params
        out[g.rows] = hidden_decode_attention(q[g.rows].contiguous(), hidden_cache, g.block_table, g.ctx_lens,
                                              w_kv, b_kv, cos, sin, k.shape[1], scale)
    elif meta.decode_hidden is not None:
        g = meta.decode_hidden
        keys, values = project_kv(hidden_cache[g.pages, g.offsets], g.positions)  # [B, L, KVH, D]
        o = F.scaled_dot_product_attention(
            q[g.rows].unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.mask, scale=scale, enable_gqa=gqa
        )
        out[g.rows] = o.squeeze(2)
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


def _chunk_mask(c: PrefillChunk, device) -> torch.Tensor:
    """Query i sits at position start_pos + i and sees keys 0..start_pos + i."""
    ctx = c.start_pos + c.num_tokens
    qpos = torch.arange(c.start_pos, ctx, device=device)[:, None]
    return torch.arange(ctx, device=device)[None, :] <= qpos

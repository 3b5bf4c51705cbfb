"""The attention backend interface, and the PyTorch path that every fast backend is checked against.

Per layer, for the flat batch of this step's tokens (``forward``):

1. write: KV requests store this step's rotated K and V, hidden requests store only x;
2. decode rows (one query token), batched by kind -- the part each backend implements its own way;
   here: KV rows gather K/V from their pages into a padded batch; hidden rows gather their stored x
   and project K/V for the whole context in one matrix product (RoPE at the original positions);
3. prefill chunks, one SDPA each: a chunk starting at position 0 attends over its fresh K/V, a
   later chunk gathers its context from the cache (of its own kind); the CPU backend has its own.

Every request reads only its own pages in its own kind, so mixed batches are exact for both kinds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_serve_ray.attention.metadata import AttentionMetadata, DecodeGroup, KVProjection, PrefillChunk
from apt_serve_ray.cache.storage import CacheStorage


class AttentionBackend:
    """The PyTorch reference backend (runs on any device). Subclasses replace the decode paths."""

    name = "torch"

    def __init__(self, fused_hidden: bool = False) -> None:
        # Whether hidden decode uses the backend's fused kernel (never forms the context's K/V).
        self.fused_hidden = fused_hidden and self.has_fused_hidden

    has_fused_hidden = False

    def describe(self) -> str:
        return f"{self.name} (hidden decode {'fused' if self.fused_hidden else 'unfused: gather x, project K/V'})"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                proj: KVProjection, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] rotated, k/v [T, KVH, D] (k rotated), x [T, HID] the K/V projection's input."""
        self.write(layer, k, v, x, meta)
        storage = meta.storage
        out = torch.empty_like(q)
        if meta.decode_kv is not None:
            g = meta.decode_kv
            out[g.rows] = self.decode_kv(layer, q[g.rows].contiguous(), g, storage, scale)
        if meta.decode_hidden is not None:
            g = meta.decode_hidden
            out[g.rows] = self.decode_hidden(layer, q[g.rows].contiguous(), g, storage, proj, scale)
        for c in meta.prefills:
            s, e = c.row_start, c.row_start + c.num_tokens
            out[s:e] = self.prefill(layer, q[s:e], k[s:e], v[s:e], c, storage, proj, scale)
        return out

    # 1. writes ------------------------------------------------------------------------------------
    @staticmethod
    def write(layer: int, k, v, x, meta: AttentionMetadata) -> None:
        storage = meta.storage
        if meta.kv_write is not None:
            w = meta.kv_write
            kv_new = torch.stack((k[w.rows], v[w.rows]), dim=1).flatten(1)
            storage.kv_token_rows[layer].index_copy_(0, w.slots, kv_new)
        if meta.hidden_write is not None:
            w = meta.hidden_write
            if storage.hidden_rows is not None:
                storage.hidden_rows[layer].index_copy_(0, w.slots, x[w.rows])
            else:
                storage.hidden[layer][w.pages, w.offsets] = x[w.rows]

    # 2. decode ------------------------------------------------------------------------------------
    def decode_kv(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        batch, length, (kvh, dim) = len(g), g.max_len, storage.kv[layer].shape[-2:]
        kv_index = _gather_index(g, "kv_index", storage)
        # One gather of head_dim rows straight into contiguous [2, B, KVH, L, D].
        kv = torch.index_select(storage.kv_head_rows[layer], 0, kv_index,
                                out=storage.workspace("decode_kv", (kv_index.numel(), dim), storage.dtype))
        kv = kv.view(2, batch, kvh, length, dim)
        return _decode_attend(q, kv[0], kv[1], _gather_index(g, "add_mask", storage), scale)

    def decode_hidden(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                      scale: float) -> torch.Tensor:
        batch, length = len(g), g.max_len
        hidden_cache = storage.hidden[layer]
        if storage.hidden_rows is not None:
            hid = hidden_cache.shape[-1]
            slots = _gather_index(g, "slots", storage)
            xs = torch.index_select(storage.hidden_rows[layer], 0, slots,
                                    out=storage.workspace("decode_x", (slots.numel(), hid), storage.dtype))
            xs = xs.view(batch, length, hid)
        else:
            xs = hidden_cache[_gather_index(g, "pages", storage), _gather_index(g, "offsets", storage)]
        keys, values = proj(xs, _gather_index(g, "positions", storage))  # [B, L, KVH, D]
        kvh, dim = keys.shape[-2:]
        kv = storage.workspace("decode_hidden_kv", (2, batch, kvh, length, dim), keys.dtype)
        kv[0].copy_(keys.transpose(1, 2))
        kv[1].copy_(values.transpose(1, 2))
        return _decode_attend(q, kv[0], kv[1], _gather_index(g, "add_mask", storage), scale)

    # 3. prefill chunks -----------------------------------------------------------------------------
    @staticmethod
    def prefill(layer: int, q, k, v, c: PrefillChunk, storage: CacheStorage, proj: KVProjection,
                scale: float) -> torch.Tensor:
        qc = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.start_pos == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            if c.is_hidden:
                positions = torch.arange(c.start_pos + c.num_tokens, device=q.device)
                keys, values = proj(storage.hidden[layer][c.pages, c.offsets], positions)
            else:
                kv = storage.kv[layer][c.pages, c.offsets]
                keys, values = kv[:, 0], kv[:, 1]
            mask, causal = _chunk_mask(c, q.device), False
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )
        return o[0].transpose(0, 1)


def _decode_attend(q, keys, values, add_mask, scale: float) -> torch.Tensor:
    """One query token per request over contiguous K/V [B, KVH, L, D]; query heads grouped per KV
    head, so grouped-query attention needs no repeated K/V. Plain batched matmuls: on CPU they beat
    the fused SDPA kernel several times for single-token queries."""
    batch, heads, dim = q.shape
    kvh = keys.shape[1]
    qg = q.view(batch, kvh, heads // kvh, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale).add_(add_mask)  # [B, KVH, G, L]
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).view(batch, heads, dim)


def _gather_index(g: DecodeGroup, name: str, storage: CacheStorage) -> torch.Tensor:
    """Padded ``[B, L]`` gather indices of a decode group, derived from its block table once per
    step (every layer reuses them). Padding slots read page 0 and are masked out."""
    if name in g.scratch:
        return g.scratch[name]
    device = g.block_table.device
    tpp, batch, length = g.tokens_per_page, len(g), g.max_len
    pos = torch.arange(length, device=device)
    pages = g.block_table.long()[:, pos // tpp]
    offsets = (pos % tpp).expand(batch, length)
    slots = pages * tpp + offsets
    padding = (pos[None, :] >= g.ctx_lens.long()[:, None])[:, None, None, :]
    add_mask = torch.zeros(padding.shape, dtype=torch.float32, device=device).masked_fill_(padding, float("-inf"))
    g.scratch.update(pages=pages, offsets=offsets, slots=slots.flatten(), positions=pos, add_mask=add_mask)
    if name == "kv_index":
        # Rows of head_dim elements: ((slot * 2 + k_or_v) * kv_heads + head), laid out [2, B, KVH, L].
        kvh = storage.layout.num_kv_heads
        g.scratch["kv_index"] = (slots.view(1, batch, 1, length) * (2 * kvh)
                                 + torch.arange(2, device=device).view(2, 1, 1, 1) * kvh
                                 + torch.arange(kvh, device=device).view(1, 1, kvh, 1)).flatten()
    return g.scratch[name]


def _chunk_mask(c: PrefillChunk, device) -> torch.Tensor:
    """Query i sits at position start_pos + i and sees keys 0..start_pos + i."""
    ctx = c.start_pos + c.num_tokens
    qpos = torch.arange(c.start_pos, ctx, device=device)[:, None]
    return torch.arange(ctx, device=device)[None, :] <= qpos

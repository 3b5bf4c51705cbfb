"""The attention backend interface, and the PyTorch path that every fast backend is checked against.

Per layer, for the flat batch of this step's tokens (``forward``):

1. write: KV requests store this step's rotated K and V, hidden requests store only x; the int8 kinds
   store the same quantised on write (``cache/quant.py``: KV per token, K or V, and head; x per token
   and ``quant_group`` elements), the scales beside the data in the page;
2. decode rows (one query token), batched by kind -- the part each backend implements its own way;
   here: KV rows gather K/V from their pages into a padded batch; hidden rows gather their stored x
   and project K/V for the whole context in one matrix product (RoPE at the original positions);
   int8 rows gather and dequantise (to the query's dtype), then attend like their base kind;
3. prefill chunks, one SDPA each: a KV or hidden chunk starting at position 0 attends over its fresh
   K/V, a later chunk reads its context from the cache in its own kind (``read_kv``); int8 chunks
   always read it from the cache, their own tokens included (just written): every key an int8
   request ever attends over is the dequantised one, so its outputs do not depend on how the
   scheduler chunked or batched it (nor on a preemption's recompute). The CPU backend has its own.

Every request reads only its own pages in their kinds, so mixed batches are exact for every kind. A
request that keeps a shared prefix in another kind (a compression in place does not rewrite the pages
other requests share; a request admitted in one kind takes a prefix cached in another) has its context
in two segments. Its decode rows, where both segments store K/V, attend each segment as a decode
group of its kind and merge the two by their log-sum-exps (``decode_segmented``: on CPU the C++ decode
kernels, which return them); its other rows go the prefill way, each segment read in its kind,
attended as one (``read_context_kv``).
Padded decode slots read any page (page 0, or the stale tail of the request's last page), whose bytes
in another kind may be NaN as floats: they are zeroed before attending, not only masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_serve_ray.attention.metadata import AttentionMetadata, DecodeGroup, KVProjection, PrefillChunk, SegmentedDecode
from apt_serve_ray.cache.quant import dequantize
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.request import CacheKind


def kv_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, 2 * KVH * D]: each token's K row then its V row, as the cache stores them. Where ``v`` sits right
    after ``k`` in each token's row (both views of one fused QKV projection's output, K not rotated into a
    new tensor), a view of that output: no copy before the cache write; otherwise one stacked copy."""
    t, kvh, d = k.shape
    if (k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == d and k.dtype == v.dtype
            and v.data_ptr() - k.data_ptr() == kvh * d * k.element_size()):
        return k.as_strided((t, 2 * kvh * d), (k.stride(0), 1))
    return torch.stack((k, v), dim=1).flatten(1)


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
                proj: KVProjection, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q [T, H, D] rotated, k/v [T, KVH, D] (k rotated), x [T, HID] the K/V projection's input.
        ``window``: a query sees only the keys less than ``window`` positions behind it (sliding-window
        layers); ``softcap``: scores go through ``softcap * tanh(score / softcap)`` (Gemma 2). Either
        one takes every row of the layer the reference way (``_forward_masked``), on every backend."""
        if window is not None or softcap is not None:
            return self._forward_masked(layer, q, k, v, x, proj, meta, scale, window, softcap)
        self.write(layer, k, v, x, meta)
        storage = meta.storage
        out = torch.empty_like(q)
        for kind, g in meta.decodes.items():
            out[g.rows] = self.decode(layer, kind, q[g.rows].contiguous(), g, storage, proj, scale)
        for seg in meta.decode_segmented:
            out[seg.rows] = self.decode_segmented(layer, q[seg.rows].contiguous(), seg, storage, scale)
        for c in meta.prefills:
            s, e = c.row_start, c.row_start + c.num_tokens
            out[s:e] = self.prefill(layer, q[s:e], k[s:e], v[s:e], c, storage, proj, scale)
        return out

    def decode(self, layer: int, kind: CacheKind, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
               scale: float) -> torch.Tensor:
        """Decode rows of one kind: its own path (the kinds that store x also need the projection)."""
        if kind.stores_hidden:
            decode = self.decode_hidden_int8 if kind.is_int8 else self.decode_hidden
            return decode(layer, q, g, storage, proj, scale)
        decode = self.decode_kv_int8 if kind.is_int8 else self.decode_kv
        return decode(layer, q, g, storage, scale)

    def decode_segmented(self, layer: int, q, seg: SegmentedDecode, storage: CacheStorage, scale: float):
        """Each segment by itself (``decode_lse``), merged by the log-sum-exps: attention over both."""
        o1, lse1 = self.decode_lse(layer, q, seg.prefix_kind, seg.prefix, storage, scale)
        o2, lse2 = self.decode_lse(layer, q, seg.kind, seg.own, storage, scale)
        return merge_segments(o1, lse1, o2, lse2)

    def decode_lse(self, layer: int, q, kind: CacheKind, g: DecodeGroup, storage: CacheStorage, scale: float):
        """Decode rows over pages of a K/V-storing kind: the output [B, H, D] and each head's log-sum-exp
        of the scaled scores (float32 [B, H]). The reference: gather, dequantise, attend."""
        valid = _gather_index(g, "valid", storage)
        keys, values = read_kv(layer, storage, kind, _gather_index(g, "pages", storage),
                               _gather_index(g, "offsets", storage), None, None, q.dtype, valid)  # [B, L, KVH, D]
        batch, heads, dim = q.shape
        kvh = keys.shape[2]
        qg = q.view(batch, kvh, heads // kvh, dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float().mul_(scale)  # [B, KVH, G, L]
        scores.masked_fill_(~valid[:, None, None], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        o = torch.matmul(torch.exp(scores - lse[..., None]).to(values.dtype), values.transpose(1, 2))
        return o.reshape(batch, heads, dim), lse.reshape(batch, heads)

    def _forward_masked(self, layer: int, q, k, v, x, proj: KVProjection, meta: AttentionMetadata, scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor:
        """Every row with an explicit mask (causal, padding, the window) and capped scores: decode rows
        read their context as a prefill chunk does (``read_kv``), in whatever kind it is held."""
        self.write(layer, k, v, x, meta)
        storage = meta.storage
        out = torch.empty_like(q)
        for kind, g in meta.decodes.items():
            if not (kind.stores_hidden or kind.is_int8):  # KV: the reference decode's gather, the window in its mask
                add_mask = _gather_index(g, "add_mask", storage)
                if window is not None:
                    pos, last = _gather_index(g, "positions", storage), g.ctx_lens.long() - 1
                    outside = pos[None, :] <= (last - window)[:, None]  # [B, L]
                    add_mask = add_mask.masked_fill(outside[:, None, None, :], float("-inf"))
                keys, values = self._gather_kv(layer, g, storage)
                out[g.rows] = _decode_attend(q[g.rows].contiguous(), keys, values, add_mask, scale, softcap)
                continue
            valid = _gather_index(g, "valid", storage)  # [B, L]
            keys, values = read_kv(layer, storage, kind, _gather_index(g, "pages", storage),
                                   _gather_index(g, "offsets", storage), proj, _gather_index(g, "positions", storage),
                                   q.dtype, valid)
            if window is not None:
                pos, last = _gather_index(g, "positions", storage), g.ctx_lens.long() - 1
                valid = valid & (pos[None, :] > (last - window)[:, None])
            out[g.rows] = masked_attention(q[g.rows][:, None], keys, values, valid[:, None], scale, softcap)[:, 0]
        for seg in meta.decode_segmented:  # both segments read, attended as one
            parts, allowed = [], []
            last = seg.prefix_tokens.long() + seg.own.ctx_lens.long() - 1
            for kind, g, start in ((seg.prefix_kind, seg.prefix, 0), (seg.kind, seg.own, seg.prefix_tokens.long())):
                valid = _gather_index(g, "valid", storage)
                parts.append(read_kv(layer, storage, kind, _gather_index(g, "pages", storage),
                                     _gather_index(g, "offsets", storage), None, None, q.dtype, valid))
                if window is not None:
                    pos = _gather_index(g, "positions", storage)[None, :] + (start[:, None] if g is seg.own else 0)
                    valid = valid & (pos > (last - window)[:, None])
                allowed.append(valid)
            keys, values = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
            out[seg.rows] = masked_attention(q[seg.rows][:, None], keys, values, torch.cat(allowed, 1)[:, None],
                                             scale, softcap)[:, 0]
        for c in meta.prefills:
            s, e = c.row_start, c.row_start + c.num_tokens
            if c.start_pos == 0 and not c.kind.is_int8 and c.segments is None:
                keys, values = k[s:e], v[s:e]
            else:
                keys, values = read_context_kv(layer, storage, c, proj, q.dtype)
            allowed = _chunk_mask(c, q.device)
            if window is not None:
                qpos = torch.arange(c.start_pos, c.start_pos + c.num_tokens, device=q.device)[:, None]
                allowed &= torch.arange(allowed.shape[1], device=q.device)[None, :] > qpos - window
            out[s:e] = masked_attention(q[None, s:e], keys[None], values[None], allowed[None], scale, softcap)[0]
        return out

    # 1. writes ------------------------------------------------------------------------------------
    @staticmethod
    def write(layer: int, k, v, x, meta: AttentionMetadata) -> None:
        storage = meta.storage
        for kind, w in meta.writes.items():
            if kind.is_int8:  # the same content, quantised on write
                data = x[w.rows] if kind.stores_hidden else torch.stack((k[w.rows], v[w.rows]), dim=1)
                storage.write_int8(layer, kind, w.pages, w.offsets, data)
            elif kind.stores_hidden:
                if storage.hidden_rows is not None:
                    storage.hidden_rows[layer].index_copy_(0, w.slots, x[w.rows])
                else:
                    storage.hidden[layer][w.pages, w.offsets] = x[w.rows]
            else:
                kv_new = kv_rows(k, v) if w.all_rows else torch.stack((k[w.rows], v[w.rows]), dim=1).flatten(1)
                storage.kv_token_rows[layer].index_copy_(0, w.slots, kv_new)

    # 2. decode ------------------------------------------------------------------------------------
    def decode_kv(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        keys, values = self._gather_kv(layer, g, storage)
        return _decode_attend(q, keys, values, _gather_index(g, "add_mask", storage), scale)

    @staticmethod
    def _gather_kv(layer: int, g: DecodeGroup, storage: CacheStorage) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, KVH, L, D] of a KV decode group: one gather of head_dim rows straight into a
        contiguous workspace, padding zeroed."""
        batch, length, (kvh, dim) = len(g), g.max_len, storage.kv[layer].shape[-2:]
        kv_index = _gather_index(g, "kv_index", storage)
        kv = torch.index_select(storage.kv_head_rows[layer], 0, kv_index,
                                out=storage.workspace("decode_kv", (kv_index.numel(), dim), storage.dtype))
        kv = kv.view(2, batch, kvh, length, dim)
        kv.masked_fill_(_gather_index(g, "padding", storage)[None, ..., None], 0)
        return kv[0], kv[1]

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
        xs.masked_fill_(_gather_index(g, "padding", storage).view(batch, length, 1), 0)
        return self._attend_projected(q, xs, g, storage, proj, scale)

    def decode_kv_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, scale: float) -> torch.Tensor:
        keys, values = read_kv(layer, storage, CacheKind.KV_INT8, _gather_index(g, "pages", storage),
                               _gather_index(g, "offsets", storage), None, None, q.dtype,
                               _gather_index(g, "valid", storage))  # [B, L, KVH, D]
        return _decode_attend(q, keys.transpose(1, 2), values.transpose(1, 2), _gather_index(g, "add_mask", storage),
                              scale)

    def decode_hidden_int8(self, layer: int, q, g: DecodeGroup, storage: CacheStorage, proj: KVProjection,
                           scale: float) -> torch.Tensor:
        xs = read_x(layer, storage, CacheKind.HIDDEN_INT8, _gather_index(g, "pages", storage),
                    _gather_index(g, "offsets", storage), q.dtype, _gather_index(g, "valid", storage))
        return self._attend_projected(q, xs, g, storage, proj, scale)

    @staticmethod
    def _attend_projected(q, xs, g: DecodeGroup, storage: CacheStorage, proj: KVProjection, scale: float):
        """The unfused hidden decode after the gather: project K/V of x [B, L, HID], then attend."""
        batch, length = len(g), g.max_len
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
        if c.start_pos == 0 and not c.kind.is_int8 and c.segments is None:
            keys, values, mask, causal = k, v, None, True
        else:
            keys, values = read_context_kv(layer, storage, c, proj, q.dtype)
            mask, causal = _chunk_mask(c, q.device), False
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )
        return o[0].transpose(0, 1)


def read_context_kv(layer: int, storage: CacheStorage, c: PrefillChunk, proj: KVProjection,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [start_pos + num_tokens, KVH, D] of a chunk's whole context, read from the cache (its own
    tokens were written before attention runs): in its kind, or segment by segment, each in its own
    kind (a shared KV prefix, then the request's compressed pages), concatenated."""
    if c.segments is None:
        positions = torch.arange(c.start_pos + c.num_tokens, device=c.pages.device)
        return read_kv(layer, storage, c.kind, c.pages, c.offsets, proj, positions, dtype)
    parts = [read_kv(layer, storage, s.kind, s.pages, s.offsets, proj, s.positions, dtype) for s in c.segments]
    return torch.cat([kv[0].to(dtype) for kv in parts]), torch.cat([kv[1].to(dtype) for kv in parts])


def read_x(layer: int, storage: CacheStorage, kind: CacheKind, pages, offsets, dtype: torch.dtype,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Stored x [..., n, HID] at ``pages``/``offsets`` [..., n] of a hidden or hidden-int8 page (the
    latter dequantised to ``dtype``). ``valid`` [..., n]: slots outside it read as zeros."""
    if not kind.is_int8:
        xs = storage.hidden[layer][pages, offsets]
        return xs if valid is None else xs.masked_fill(~valid[..., None], 0)
    scales = storage.hidden_int8_scale[layer][pages, offsets]
    if valid is not None:  # zero scales make the slot exactly 0 whatever its bytes
        scales = scales.masked_fill(~valid[..., None], 0)
    return dequantize(storage.hidden_int8[layer][pages, offsets], scales, storage.layout.quant_group, dtype)


def read_kv(layer: int, storage: CacheStorage, kind: CacheKind, pages, offsets, proj: KVProjection | None,
            positions, dtype: torch.dtype, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [..., n, KVH, D] (K rotated) of the tokens stored at ``pages``/``offsets`` [..., n] in
    ``kind``: read, dequantised to ``dtype``, and projected from x at ``positions`` [n] (``proj``)
    for the kinds that store x. ``valid`` [..., n]: slots outside it read as zeros (padding)."""
    if kind.stores_hidden:
        return proj(read_x(layer, storage, kind, pages, offsets, dtype, valid), positions)
    if not kind.is_int8:
        kv = storage.kv[layer][pages, offsets]  # [..., n, 2, KVH, D]
        if valid is not None:
            kv = kv.masked_fill(~valid[..., None, None, None], 0)
    else:
        data, scales = storage.kv_int8[layer][pages, offsets], storage.kv_int8_scale[layer][pages, offsets]
        if valid is not None:
            scales = scales.masked_fill(~valid[..., None, None], 0)
        kv = dequantize(data.flatten(-3), scales.flatten(-2), data.shape[-1], dtype).view(data.shape)
    return kv[..., 0, :, :], kv[..., 1, :, :]


def _decode_attend(q, keys, values, add_mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query token per request over contiguous K/V [B, KVH, L, D]; query heads grouped per KV
    head, so grouped-query attention needs no repeated K/V. Plain batched matmuls: on CPU they beat
    the fused SDPA kernel several times for single-token queries. ``softcap``: scores capped by
    ``softcap * tanh(score / softcap)`` before the mask (Gemma 2)."""
    batch, heads, dim = q.shape
    kvh = keys.shape[1]
    qg = q.view(batch, kvh, heads // kvh, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale)  # [B, KVH, G, L]
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.add_(add_mask)
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).view(batch, heads, dim)


def merge_segments(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two parts of a context, each normalised by itself with its log-sum-exp [B, H]
    (the flash-decoding merge): weights exp(lse - max), outputs averaged by them."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m)[..., None], torch.exp(lse2 - m)[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def masked_attention(q, keys, values, allowed, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [B, n, H, D] over keys / values [B, L, KVH, D] where ``allowed`` [B, n, L]; query heads grouped
    per KV head (grouped-query attention needs no repeated K/V). Scores in float32, capped by
    ``softcap * tanh(score / softcap)`` when given (Gemma 2), before the mask, as transformers does."""
    batch, n, heads, dim = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(batch, n, kvh, heads // kvh, dim).permute(0, 2, 3, 1, 4)  # [B, KVH, G, n, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1).unsqueeze(2)).float().mul_(scale)  # [B, KVH, G, n, L]
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    o = torch.matmul(scores.softmax(-1).to(values.dtype), values.permute(0, 2, 1, 3).unsqueeze(2))
    return o.permute(0, 3, 1, 2, 4).reshape(batch, n, heads, dim)


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
    valid = pos[None, :] < g.ctx_lens.long()[:, None]  # [B, L]
    padding = ~valid[:, None, :]  # [B, 1, L]: zeroed in gathered K/V or x, -inf in the scores
    add_mask = torch.zeros((batch, 1, 1, length), dtype=torch.float32, device=device)
    add_mask.masked_fill_(padding[:, None], float("-inf"))
    g.scratch.update(pages=pages, offsets=offsets, slots=slots.flatten(), positions=pos, add_mask=add_mask,
                     valid=valid, padding=padding)
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

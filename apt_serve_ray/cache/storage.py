"""The cache tensors: one ``[num_pages, page_elems]`` tensor per layer, viewed per page kind.

The same page id addresses the same slot in every layer. See ``layout.py`` for what a page holds.
Int8 kinds view the same memory as bytes: ``kv_int8[l]`` ``[P, T, 2, KVH, D]`` int8 with
``kv_int8_scale[l]`` ``[P, T, 2, KVH]`` float32; ``hidden_int8[l]`` ``[P, T, HID]`` int8 with
``hidden_int8_scale[l]`` ``[P, T, HID // group]`` float32 (page stride ``page_bytes`` bytes).
"""

from __future__ import annotations

import torch

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.quant import quantize
from apt_serve_ray.request import CacheKind


class CacheStorage:
    def __init__(self, layout: CacheLayout, num_pages: int, device, dtype: torch.dtype) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.dtype = dtype
        self.layers = [torch.zeros(num_pages, layout.page_elems, device=device, dtype=dtype) for _ in range(layout.num_layers)]
        tpp = layout.tokens_per_page(CacheKind.HIDDEN)
        # KV view [pages, block_size, 2, kv_heads, head_dim]; hidden view [pages, tokens, hidden].
        self.kv = [t.view(num_pages, layout.block_size, 2, layout.num_kv_heads, layout.head_dim) for t in self.layers]
        self.hidden = [t[:, : tpp * layout.hidden_size].view(num_pages, tpp, layout.hidden_size) for t in self.layers]
        # Flat row views for single-index gathers/scatters (rows: one token, or one head of K or V).
        self.kv_token_rows = [t.view(num_pages * layout.block_size, 2 * layout.kv_dim) for t in self.layers]
        self.kv_head_rows = [t.view(-1, layout.head_dim) for t in self.layers]
        flat_hidden = tpp * layout.hidden_size == layout.page_elems  # MHA: hidden pages have no tail
        self.hidden_rows = [t.view(-1, layout.hidden_size) for t in self.layers] if flat_hidden else None
        # Int8 kinds: byte views of the same pages (data, then scales at the layout's offset).
        self.bytes = [t.view(torch.uint8) for t in self.layers]  # [P, page_bytes]
        self.kv_int8, self.kv_int8_scale = self._int8_views(CacheKind.KV_INT8, (2, layout.num_kv_heads, layout.head_dim))
        self.hidden_int8, self.hidden_int8_scale = self._int8_views(CacheKind.HIDDEN_INT8, (layout.hidden_size,))
        self._workspaces: dict[str, torch.Tensor] = {}

    def _int8_views(self, kind: CacheKind, token_shape: tuple[int, ...]):
        geo = self.layout.int8(kind)
        tpp, p = geo.tokens_per_page, self.num_pages
        if tpp == 0:
            return None, None
        data = [b[:, : tpp * geo.token_elems].view(torch.int8).view(p, tpp, *token_shape) for b in self.bytes]
        end = geo.scale_offset + tpp * geo.scales_per_token * 4
        scale_shape = (2, self.layout.num_kv_heads) if kind is CacheKind.KV_INT8 else (geo.scales_per_token,)
        scales = [b[:, geo.scale_offset:end].view(torch.float32).view(p, tpp, *scale_shape) for b in self.bytes]
        return data, scales

    def write_int8(self, layer: int, kind: CacheKind, pages, offsets, content: torch.Tensor) -> None:
        """Quantise ``content`` and store it, with its scales, at ``pages``/``offsets`` [n] of an int8
        kind: K/V [n, 2, KVH, D] for kv-int8, x [n, HID] for hidden-int8."""
        if kind is CacheKind.KV_INT8:
            data, scales = quantize(content.flatten(1), content.shape[-1])
            self.kv_int8[layer][pages, offsets] = data.view(content.shape)
            self.kv_int8_scale[layer][pages, offsets] = scales.view(content.shape[:-1])
        elif kind is CacheKind.HIDDEN_INT8:
            data, scales = quantize(content, self.layout.quant_group)
            self.hidden_int8[layer][pages, offsets] = data
            self.hidden_int8_scale[layer][pages, offsets] = scales
        else:
            raise ValueError(f"kind: {kind.value} is not an int8 kind")

    def workspace(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A scratch buffer reused across layers and steps (fresh multi-MB allocations are slow)."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._workspaces.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._workspaces[name] = torch.empty(max(numel, 1), dtype=dtype, device=self.layers[0].device)
        return buf[:numel].view(shape)


def token_rows(layout: CacheLayout, page_bytes: torch.Tensor, kind: CacheKind, dtype: torch.dtype) -> torch.Tensor:
    """The tokens held in pages of a full-precision kind, from their raw bytes ``[n, page_bytes]``
    (a copy in the tier): K/V ``[n * block_size, 2, KVH, D]`` for kv, x ``[n * tokens, HID]`` for hidden."""
    n, elems = page_bytes.shape[0], page_bytes.contiguous().view(dtype)
    if kind is CacheKind.KV:
        return elems.view(n * layout.block_size, 2, layout.num_kv_heads, layout.head_dim)
    if kind is CacheKind.HIDDEN:
        tpp = layout.tokens_per_page(kind)
        return elems[:, : tpp * layout.hidden_size].reshape(n * tpp, layout.hidden_size)
    raise ValueError(f"kind: {kind.value} pages are not read as full-precision tokens")

"""The cache tensors: one ``[num_pages, page_elems]`` tensor per layer, viewed per page kind.

The same page id addresses the same slot in every layer. See ``layout.py`` for what a page holds.
Int8 kinds view the same memory as bytes: ``kv_int8[l]`` ``[P, T, 2, KVH, D]`` int8 with
``kv_int8_scale[l]`` ``[P, T, 2, KVH]`` float32; ``hidden_int8[l]`` ``[P, T, HID]`` int8 with
``hidden_int8_scale[l]`` ``[P, T, HID // group]`` float32 (page stride ``page_bytes`` bytes).
"""

from __future__ import annotations

import torch

from apt_serve_ray.cache.kinds import SPECS, CacheKind, KindSpec
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.quant import quantize


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
        # Int8 kinds: byte views of the same pages (data, then scales at the layout's offset), named by
        # their specs: ``kv_int8`` and ``kv_int8_scale``, ``hidden_int8`` and ``hidden_int8_scale``.
        self.bytes = [t.view(torch.uint8) for t in self.layers]  # [P, page_bytes]
        for spec in SPECS:
            if spec.int8:
                data, scales = self._int8_views(spec)
                setattr(self, spec.view, data)
                setattr(self, spec.view + "_scale", scales)
        self._workspaces: dict[str, torch.Tensor] = {}

    def view(self, kind: CacheKind) -> list[torch.Tensor]:
        """The per-layer view of pages of ``kind`` (``kv``, ``hidden``, ``kv_int8``, ``hidden_int8``)."""
        return getattr(self, kind.spec.view)

    def _int8_views(self, spec: KindSpec):
        geo = self.layout.int8(spec.kind)
        tpp, p = geo.tokens_per_page, self.num_pages
        if tpp == 0:
            return None, None
        token_shape, scale_shape = spec.token_shape(self.layout), spec.scale_shape(self.layout)
        data = [b[:, : tpp * geo.token_elems].view(torch.int8).view(p, tpp, *token_shape) for b in self.bytes]
        end = geo.scale_offset + tpp * geo.scales_per_token * 4
        scales = [b[:, geo.scale_offset:end].view(torch.float32).view(p, tpp, *scale_shape) for b in self.bytes]
        return data, scales

    def write_int8(self, layer: int, kind: CacheKind, pages, offsets, content: torch.Tensor) -> None:
        """Quantise ``content`` and store it, with its scales, at ``pages``/``offsets`` [n] of an int8
        kind: K/V [n, 2, KVH, D] for kv-int8, x [n, HID] for hidden-int8."""
        spec = kind.spec
        if not spec.int8:
            raise ValueError(f"kind: {kind.value} is not an int8 kind")
        data, scales = quantize(content.flatten(1), spec.scale_group(self.layout))
        getattr(self, spec.view)[layer][pages, offsets] = data.view(content.shape)
        scale_shape = (len(content), *spec.scale_shape(self.layout))
        getattr(self, spec.view + "_scale")[layer][pages, offsets] = scales.view(scale_shape)

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
    spec = kind.spec
    if spec.int8:
        raise ValueError(f"kind: {kind.value} pages are not read as full-precision tokens")
    n, elems = page_bytes.shape[0], page_bytes.contiguous().view(dtype)
    tpp = layout.tokens_per_page(kind)
    return elems[:, : tpp * spec.token_elems(layout)].reshape(n * tpp, *spec.token_shape(layout))

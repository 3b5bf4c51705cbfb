"""The cache tensors: one ``[num_pages, page_elems]`` tensor per layer, viewed per page kind.

The same page id addresses the same slot in every layer. See ``layout.py`` for what a page holds.
"""

from __future__ import annotations

import torch

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.request import CacheKind


class CacheStorage:
    def __init__(self, layout: CacheLayout, num_pages: int, device, dtype: torch.dtype) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.layers = [torch.zeros(num_pages, layout.page_elems, device=device, dtype=dtype) for _ in range(layout.num_layers)]
        tpp = layout.tokens_per_page(CacheKind.HIDDEN)
        # KV view [pages, block_size, 2, kv_heads, head_dim]; hidden view [pages, tokens, hidden].
        self.kv = [t.view(num_pages, layout.block_size, 2, layout.num_kv_heads, layout.head_dim) for t in self.layers]
        self.hidden = [t[:, : tpp * layout.hidden_size].view(num_pages, tpp, layout.hidden_size) for t in self.layers]

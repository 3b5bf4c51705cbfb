"""Geometry of the hybrid cache for one model: what a page holds in each kind, and what it costs.

A page is ``page_elems`` elements in every layer. Token-major inside a page::

    KV page      [block_size tokens][2 (k, v)][num_kv_heads][head_dim]   page_elems = block_size*2*kv_dim
    hidden page  [tokens_per_page  ][hidden_size]  (+ unused tail)        tokens = page_elems // hidden

For MHA (kv_dim == hidden) a hidden page holds exactly 2x the tokens of a KV page. For grouped-query
models it holds fewer, so the hidden kind saves nothing there and is disabled unless forced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from apt_serve_ray.request import CacheKind


@dataclass(frozen=True)
class CacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    block_size: int
    dtype_bytes: int

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def page_elems(self) -> int:
        return self.block_size * 2 * self.kv_dim

    @property
    def bytes_per_page(self) -> int:
        return self.num_layers * self.page_elems * self.dtype_bytes

    def tokens_per_page(self, kind: CacheKind) -> int:
        if kind is CacheKind.KV:
            return self.block_size
        return self.page_elems // self.hidden_size

    def bytes_per_token(self, kind: CacheKind) -> int:
        per_layer = 2 * self.kv_dim if kind is CacheKind.KV else self.hidden_size
        return self.num_layers * per_layer * self.dtype_bytes

    @property
    def hidden_ratio(self) -> float:
        """h: bytes of the hidden cache per byte of the KV cache (0.5 for MHA, 1.5 for SmolLM2)."""
        return self.hidden_size / (2 * self.kv_dim)

    @property
    def hidden_saves_memory(self) -> bool:
        return self.tokens_per_page(CacheKind.HIDDEN) > self.block_size

    def num_pages_for(self, num_tokens: int, kind: CacheKind) -> int:
        return math.ceil(num_tokens / self.tokens_per_page(kind))

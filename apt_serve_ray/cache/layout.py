"""Geometry of the cache for one model: what a page holds in each kind, and what it costs.

A page is ``page_elems`` elements of the model's dtype in every layer (``page_bytes`` bytes); every
kind fills the same pages. Token-major inside a page::

    kv           [block_size tokens][2 (k, v)][num_kv_heads][head_dim]   page_elems = block_size*2*kv_dim
    hidden       [tokens_per_page  ][hidden_size]  (+ unused tail)        tokens = page_elems // hidden
    kv-int8      bytes: [tokens][2][num_kv_heads][head_dim] int8, then at ``scale_offset``
                 [tokens][2][num_kv_heads] float32 scales (one per token, K or V, and head)
    hidden-int8  bytes: [tokens][hidden_size] int8, then [tokens][hidden_size // group] float32 scales
                 (one per token and group of ``quant_group`` elements; ``head_dim`` where it divides)

Quantisation is symmetric: ``q = round(x / s)``, ``s = max|x| / 127`` over the token's head or group
(``cache/quant.py``); the scales count in the page's bytes, so an int8 page holds fewer than
``page_bytes / elements`` tokens (OPT-125m in bf16: 30 kv-int8 tokens per 16-token page, 1.88x).

For MHA (kv_dim == hidden) a hidden page holds exactly 2x the tokens of a KV page. For grouped-query
models it holds fewer, so the hidden kind saves nothing there and is disabled unless forced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from apt_serve_ray.cache.kinds import SPECS, CacheKind

SCALE_BYTES = 4  # float32 scales
_SCALE_ALIGN = 16


@dataclass(frozen=True)
class Int8Geometry:
    """Where an int8 kind's data and scales sit in one layer's page (bytes)."""

    tokens_per_page: int
    token_elems: int  # int8 values per token (2 * kv_dim, or hidden_size)
    scales_per_token: int  # 2 * num_kv_heads, or hidden_size // group
    group: int  # elements per scale (head_dim for KV; quant_group for hidden)
    scale_offset: int  # byte offset of the scales in the page

    @property
    def bytes_per_token(self) -> int:
        return self.token_elems + SCALE_BYTES * self.scales_per_token


def _int8_geometry(page_bytes: int, token_elems: int, scales_per_token: int, group: int) -> Int8Geometry:
    per_token = token_elems + SCALE_BYTES * scales_per_token
    tpp = page_bytes // per_token
    while tpp > 0:
        offset = -(-tpp * token_elems // _SCALE_ALIGN) * _SCALE_ALIGN
        if offset + tpp * scales_per_token * SCALE_BYTES <= page_bytes:
            return Int8Geometry(tpp, token_elems, scales_per_token, group, offset)
        tpp -= 1
    return Int8Geometry(0, token_elems, scales_per_token, group, 0)


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
    def page_bytes(self) -> int:
        """Bytes of one page in one layer."""
        return self.page_elems * self.dtype_bytes

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all layers (what one page id costs)."""
        return self.num_layers * self.page_bytes

    @property
    def quant_group(self) -> int:
        """Elements of x per scale in hidden-int8 pages."""
        return self.head_dim if self.hidden_size % self.head_dim == 0 else self.hidden_size

    @cached_property
    def _int8(self) -> dict[CacheKind, Int8Geometry]:
        """Each int8 kind's geometry, from its spec: the elements of a token, and how many share a scale."""
        geos = {}
        for spec in SPECS:
            if spec.int8:
                group = spec.scale_group(self)
                elems = spec.token_elems(self)
                geos[spec.kind] = _int8_geometry(self.page_bytes, elems, elems // group, group)
        return geos

    def int8(self, kind: CacheKind) -> Int8Geometry:
        geo = self._int8.get(kind)
        if geo is None:
            raise ValueError(f"kind: {kind.value} is not an int8 kind")
        return geo

    @cached_property
    def _tokens_per_page(self) -> dict[CacheKind, int]:
        """Full precision: as many tokens as fit the page's elements (kv: ``block_size``); int8: the geometry's."""
        return {s.kind: self.int8(s.kind).tokens_per_page if s.int8 else self.page_elems // s.token_elems(self)
                for s in SPECS}

    def tokens_per_page(self, kind: CacheKind) -> int:
        return self._tokens_per_page[kind]

    def bytes_per_token(self, kind: CacheKind) -> int:
        """Bytes one token takes over all layers (scales included), not counting a page's unused tail."""
        if kind.is_int8:
            return self.num_layers * self.int8(kind).bytes_per_token
        return self.num_layers * kind.spec.token_elems(self) * self.dtype_bytes

    @property
    def hidden_ratio(self) -> float:
        """h: bytes of the hidden cache per byte of the KV cache (0.5 for MHA, 1.5 for SmolLM2)."""
        return self.hidden_size / (2 * self.kv_dim)

    @property
    def hidden_saves_memory(self) -> bool:
        return self.tokens_per_page(CacheKind.HIDDEN) > self.block_size

    def saves_memory(self, kind: CacheKind) -> bool:
        """Whether a page of ``kind`` holds more tokens than a KV page."""
        return self.tokens_per_page(kind) > self.block_size

    def num_pages_for(self, num_tokens: int, kind: CacheKind) -> int:
        return math.ceil(num_tokens / self.tokens_per_page(kind))

    def describe(self, num_pages: int, enable_hybrid_cache: bool, force_hidden: bool) -> str:
        """One line for the engine's start-up log: whether the hybrid cache saves memory for this model."""
        kv, hid = self.bytes_per_token(CacheKind.KV), self.bytes_per_token(CacheKind.HIDDEN)
        pages = f"{num_pages} pages of {self.bytes_per_page} B"
        if not enable_hybrid_cache:
            return f"hybrid cache disabled (enable_hybrid_cache=False): KV pages only; {pages}"
        if self.hidden_saves_memory:
            return f"hybrid cache on: hidden {hid} B/token vs KV {kv} B/token (ratio {self.hidden_ratio:.2f}); {pages}"
        how = "hidden kind FORCED on for testing" if force_hidden else "KV pages only"
        return (f"hybrid cache off for this model: hidden state {hid} B/token >= KV {kv} B/token "
                f"(grouped-query attention); {how}; {pages}")

"""What one step's attention needs to know, built by the model runner once per step and read by every
layer: where this step's tokens are written, which rows decode over which pages, the prefill chunks,
and (per layer, built once by the model) the weights that turn a stored x into K and V."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.request import CacheKind

if TYPE_CHECKING:
    from apt_serve_ray.attention.backend import AttentionBackend
    from apt_serve_ray.models.rotary import RotaryEmbedding


@dataclass(frozen=True)
class KVProjection:
    """One layer's K/V projection: ``k, v = split(x @ w_kv^T + b_kv)``, K rotated for RoPE models.

    ``w_kv`` is ``[2 * KVH * D, HID]``: the K rows, then the V rows (a view of the fused QKV weight)."""

    w_kv: torch.Tensor
    b_kv: torch.Tensor | None
    num_kv_heads: int
    head_dim: int
    rotary: "RotaryEmbedding | None" = None
    k_norm: torch.Tensor | None = None  # [D]: RMSNorm over each K head before RoPE (Qwen3, Gemma 3)
    eps: float = 1e-6
    # Gemma's RMSNorm: scaled by (1 + weight) in float32, then cast (Llama's casts, then scales).
    gemma_norm: bool = False

    @property
    def has_rope(self) -> bool:
        return self.rotary is not None

    @property
    def fusable(self) -> bool:
        """Whether the fused hidden-decode kernels compute this projection (a linear map, then RoPE
        over whole heads); otherwise hidden rows project through ``__call__``."""
        return self.k_norm is None and not (self.rotary is not None and self.rotary.is_partial)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored x [..., n, HID] at positions [n] -> K, V [..., n, KVH, D], K rotated."""
        kv = F.linear(x, self.w_kv, self.b_kv).unflatten(-1, (2, self.num_kv_heads, self.head_dim))
        k, v = kv.unbind(-3)
        if self.k_norm is not None:  # as the model's forward: float32 statistics
            h = k.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            k = (h * (1.0 + self.k_norm.float())).to(k.dtype) if self.gemma_norm else self.k_norm * h.to(k.dtype)
        if self.rotary is not None:
            k = self.rotary.apply(k, positions)
        return k, v


@dataclass
class SlotWrite:
    rows: torch.Tensor  # rows of this step's flat token batch
    pages: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor  # page * tokens_per_page + offset
    all_rows: bool = False  # rows are every row of the step, in order (the writes need not pick them)


@dataclass
class DecodeGroup:
    """Decode rows of one kind (one query token each) and the pages they attend over.

    ``block_table[i, j]`` is request i's j-th page (padded with page 0); request i attends over its
    first ``ctx_lens[i]`` tokens, the new one included (written before attention runs)."""

    rows: torch.Tensor  # [B] rows of the flat batch
    block_table: torch.Tensor  # [B, max_pages] int32
    ctx_lens: torch.Tensor  # [B] int32
    max_len: int
    tokens_per_page: int
    scratch: dict[str, Any] = field(default_factory=dict)  # per-step derived indices a backend caches

    def __len__(self) -> int:
        return self.rows.numel()


@dataclass
class ContextSegment:
    """Consecutive tokens of a request's context held in one kind: the page and offset of each, and
    its position (K is rotated, and x projected, where the token sits)."""

    kind: CacheKind
    pages: torch.Tensor  # [n]
    offsets: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]


@dataclass
class PrefillChunk:
    """Rows of one request that attend causally over its context: a prompt chunk, or (``segments``)
    any rows of a request that keeps a shared prefix in another kind than its own pages."""

    row_start: int
    num_tokens: int
    start_pos: int  # position of the chunk's first token
    kind: CacheKind  # the kind of the request's pages (what a later chunk reads its context from)
    pages: torch.Tensor | None = None  # [ctx] page of each context slot: start_pos > 0, or an int8 kind
    offsets: torch.Tensor | None = None
    block_table: torch.Tensor | None = None  # [pages] int32: the request's pages (kv and kv-int8 chunks)
    # The context in more than one kind (a shared prefix, then the request's own pages), in order;
    # read segment by segment and attended as one. None: all of it in ``kind``.
    segments: list[ContextSegment] | None = None

    @property
    def is_hidden(self) -> bool:
        """The pages hold x (hidden, hidden-int8), not K/V."""
        return self.kind.stores_hidden


@dataclass
class SegmentedDecode:
    """Decode rows of requests that keep a shared prefix in ``prefix_kind`` and their own pages in
    ``kind`` (both kinds storing K/V): each segment is attended by itself as a decode group of its kind
    (``prefix``: the prefix pages, ``ctx_lens`` the prefix tokens; ``own``: the pages after it, the new
    token included) and the two are merged by their log-sum-exps (``merge_segments``)."""

    rows: torch.Tensor  # [B] rows of the flat batch
    prefix_kind: CacheKind
    kind: CacheKind
    prefix: DecodeGroup
    own: DecodeGroup
    prefix_tokens: torch.Tensor  # [B]: where each request's own segment starts (its positions)

    def __len__(self) -> int:
        return self.rows.numel()


@dataclass
class AttentionMetadata:
    """One step's writes and decode groups, keyed by cache kind (a kind with no row this step has
    none), its decode rows over two segments, and its prefill chunks (each carries its own kind). A
    decode group's ``tokens_per_page`` is its kind's; int8 writes store q and its scales
    (``cache/quant.py``) in the kind's storage views."""

    storage: CacheStorage
    num_tokens: int
    backend: "AttentionBackend"
    writes: dict[CacheKind, SlotWrite] = field(default_factory=dict)
    decodes: dict[CacheKind, DecodeGroup] = field(default_factory=dict)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_segmented: list[SegmentedDecode] = field(default_factory=list)  # per (prefix kind, kind)

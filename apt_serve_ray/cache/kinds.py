"""The cache kinds: what a page can hold, one frozen spec each, in one ordered registry.

Every kind fills the same fixed-size pages (``layout.py``). A kind is what it stores (K and V, or the
layer input x from which K/V are projected when attended) and whether that is quantised to int8
(with float32 scales beside it in the page). ``CacheKind`` is the public name of a kind; its
properties, the layout's geometry, the storage's views, the conversions, the config's names and the
scheduler's order all read ``SPECS``. A new kind is a member of ``CacheKind`` and a spec here (plus its
kernels: an attention backend's ``decode_<view>``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheKind(str, enum.Enum):
    """What a request's pages hold. Every kind fills the same fixed-size pages (``cache/layout.py``).

    ``kv``: K and V in the model's dtype (exact). ``hidden``: the layer input x; K/V are projected from
    it when attended (exact, fewer bytes for multi-head models, costs compute). ``kv-int8`` and
    ``hidden-int8``: the same, quantised to int8 with a float32 scale per token and head (KV) or per
    token and group of ``head_dim`` elements (hidden), stored beside the data in the page (lossy).
    Every kind but ``kv`` is *compressed*: ``cache_ratio`` caps their share of the pool.
    """

    KV = "kv"
    HIDDEN = "hidden"
    KV_INT8 = "kv-int8"
    HIDDEN_INT8 = "hidden-int8"

    # Each member's spec and what follows from it (set from ``SPECS`` below, as the module loads):
    spec: KindSpec  # its entry in ``SPECS``
    stores_hidden: bool  # pages hold x (hidden, hidden-int8), not K/V
    is_int8: bool  # pages hold int8 data and float32 scales (kv-int8, hidden-int8)
    is_compressed: bool  # every kind but kv (``cache_ratio`` caps their share of the pool)
    base: CacheKind  # the full-precision kind that stores the same thing (kv or hidden)
    compresses_to: CacheKind | None  # the int8 kind its pages are quantised to, in place or back from the tier
    upgrades_to: CacheKind | None  # the kind a compressed kind goes back to in place (kv); None for kv


@dataclass(frozen=True)
class KindSpec:
    """One cache kind: what its pages store, per token and layer, and how it changes into the others."""

    kind: CacheKind
    stores_hidden: bool  # x [hidden_size] per token; else K and V [2, num_kv_heads, head_dim]
    int8: bool  # quantised, a float32 scale per group of ``scale_group`` elements stored in the page
    view: str  # its ``CacheStorage`` attribute (int8: and ``<view>_scale``); an attention backend's ``decode_<view>``
    # How its extra decode-step time is priced (``scheduler/costs.py``): "none" (the reference), "rho"
    # (the step-time model's hidden context, and rho per page), "measured" (``StepCosts.kind_costs``).
    cost: str
    cost_rank: int | None = None  # among the compressed kinds, by step time, cheapest first (the offer order)
    compresses_to: CacheKind | None = None  # the int8 kind of the same content (kv -> kv-int8, hidden -> hidden-int8)
    # What it goes back to in place: kv. None for kv itself, the one kind that is not *compressed*
    # (every other kind is: ``cache_ratio`` caps their share of the pool).
    upgrades_to: CacheKind | None = None

    @property
    def name(self) -> str:
        return self.kind.value

    def token_shape(self, layout) -> tuple[int, ...]:
        """One token's elements in one layer, before any quantisation: K and V, or x."""
        if self.stores_hidden:
            return (layout.hidden_size,)
        return (2, layout.num_kv_heads, layout.head_dim)

    def token_elems(self, layout) -> int:
        return layout.hidden_size if self.stores_hidden else 2 * layout.kv_dim

    def scale_group(self, layout) -> int:
        """Elements per scale where quantised: a head of K or V, or ``quant_group`` elements of x."""
        return layout.quant_group if self.stores_hidden else layout.head_dim

    def scale_shape(self, layout) -> tuple[int, ...]:
        """One token's scales in one layer where quantised: [2, num_kv_heads], or [hidden // group]."""
        if self.stores_hidden:
            return (layout.hidden_size // layout.quant_group,)
        return (2, layout.num_kv_heads)


_K = CacheKind
# The registry, in the order of the scheduler's columns and codes (``scheduler/candidates.py``): KV first.
SPECS: tuple[KindSpec, ...] = (
    KindSpec(_K.KV, stores_hidden=False, int8=False, view="kv", cost="none", compresses_to=_K.KV_INT8),
    KindSpec(_K.HIDDEN, stores_hidden=True, int8=False, view="hidden", cost="rho", cost_rank=1,
             compresses_to=_K.HIDDEN_INT8, upgrades_to=_K.KV),
    KindSpec(_K.KV_INT8, stores_hidden=False, int8=True, view="kv_int8", cost="measured", cost_rank=0,
             upgrades_to=_K.KV),
    KindSpec(_K.HIDDEN_INT8, stores_hidden=True, int8=True, view="hidden_int8", cost="measured", cost_rank=2,
             upgrades_to=_K.KV),
)
KINDS: tuple[CacheKind, ...] = tuple(s.kind for s in SPECS)


def _attach() -> None:
    """Give every member its spec and the fields that follow from it; the registry and the enum must
    name the same kinds, KV first."""
    if sorted(KINDS) != sorted(CacheKind) or len(set(KINDS)) != len(KINDS) or KINDS[0] is not CacheKind.KV:
        raise RuntimeError("cache/kinds.py: SPECS and CacheKind disagree, or KV is not first")
    for spec in SPECS:
        kind = spec.kind
        kind.spec, kind.stores_hidden, kind.is_int8 = spec, spec.stores_hidden, spec.int8
        kind.is_compressed = spec.upgrades_to is not None
        kind.compresses_to, kind.upgrades_to = spec.compresses_to, spec.upgrades_to
        bases = [s.kind for s in SPECS if s.stores_hidden == spec.stores_hidden and not s.int8]
        if len(bases) != 1:
            raise RuntimeError(f"cache/kinds.py: {spec.name} has {len(bases)} full-precision kinds storing the same")
        kind.base = bases[0]
    for spec in SPECS:
        to = spec.compresses_to
        if to is not None and (not to.is_int8 or to.base is not spec.kind):
            raise RuntimeError(f"cache/kinds.py: {spec.name} compresses to {to.value}, not its own int8 kind")
        if (spec.cost_rank is None) != (spec.upgrades_to is None):
            raise RuntimeError(f"cache/kinds.py: {spec.name}: a compressed kind has a cost rank, kv none")


_attach()
COMPRESSED: tuple[CacheKind, ...] = tuple(k for k in KINDS if k.is_compressed)  # hidden, kv-int8, hidden-int8
BY_COST: tuple[CacheKind, ...] = tuple(sorted(COMPRESSED, key=lambda k: k.spec.cost_rank))  # kv-int8, hidden, ...
STORE_HIDDEN: tuple[CacheKind, ...] = tuple(k for k in KINDS if k.stores_hidden)  # hidden, hidden-int8

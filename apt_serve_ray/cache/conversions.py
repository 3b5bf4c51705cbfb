"""Running requests change kind in place: an upgrade back to KV, or a compression to the int8 kind of
the same content. Each makes a ``ConversionPlan`` the runner carries out before the step's forward
pass; the pages it gives up come back after the step (``BlockTables.defer``)."""

from __future__ import annotations

from dataclasses import dataclass

from apt_serve_ray.cache.block_tables import BlockTables, merge_prefix_segment
from apt_serve_ray.cache.kinds import KINDS, CacheKind
from apt_serve_ray.request import Request


@dataclass(frozen=True)
class ConversionPlan:
    """A running request changes kind in place: the ``num_tokens`` tokens from position ``start_token``
    held in ``src_pages`` (of ``from_kind``) are written into ``dst_pages`` (of ``to_kind``). An upgrade (to KV: K/V projected
    from x, dequantised, or both) or a compression (``can_convert``: quantised to the int8 kind of the
    same content). The source pages are released after the step has read them."""

    request_id: str
    num_tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    from_kind: CacheKind = CacheKind.HIDDEN
    to_kind: CacheKind = CacheKind.KV
    start_token: int = 0  # position of the first token converted (after a shared prefix kept as it is)

    @property
    def is_upgrade(self) -> bool:
        return not self.to_kind.is_compressed


# Kinds a copy in the tier can be turned into on its way back, without recomputing: quantised as it
# is read (the int8 kind of the same content). The other way (int8 -> full precision) keeps the error,
# and KV -> hidden is impossible (x is gone): those come back in their own kind, or are recomputed.
CONVERSIONS = frozenset((kind, kind.compresses_to) for kind in KINDS if kind.compresses_to is not None)


def can_convert(from_kind: CacheKind | None, to_kind: CacheKind | None) -> bool:
    """Whether a copy of ``from_kind`` in the tier can come back as ``to_kind`` pages (same kind: yes)."""
    return from_kind is to_kind or (from_kind, to_kind) in CONVERSIONS


class Conversions:
    def __init__(self, tables: BlockTables) -> None:
        self.tables = tables
        self.pool = tables.pool
        self.layout = tables.layout

    def upgrade(self, request: Request, num_total_tokens: int) -> ConversionPlan | None:
        """Switch a request in a compressed kind to KV pages big enough for ``num_total_tokens``; the
        runner fills them from the old pages, which come back after the step. A shared prefix it keeps
        in another kind (``prefix_kind``) stays as it is: only its own tokens change kind. Returns None
        if there is not enough memory."""
        if request.kind is None or not request.kind.is_compressed:
            raise ValueError(f"request {request.request_id} holds no compressed pages")
        to_kind = request.kind.upgrades_to
        head, start = request.num_prefix_pages, request.num_prefix_tokens
        pages = self.pool.allocate(self.layout.num_pages_for(max(0, num_total_tokens - start), to_kind),
                                   to_kind, request.request_id)
        if pages is None:
            return None
        own = request.page_ids[head:]
        plan = ConversionPlan(request.request_id, request.num_computed_tokens - start, own, pages,
                              request.kind, to_kind, start)
        self.tables.defer(own[::-1], request.request_id)
        exact = not request.kind.is_int8  # K/V projected from x: what a forward pass writes
        request.kind = request.last_kind = to_kind
        request.page_ids = request.page_ids[:head] + pages
        # Named again after the step has written them (``name_computed_pages``), where exact; dequantised
        # K/V are not what a KV request would compute, and must not be found as such.
        request.num_named_pages = head if exact else -1
        request.num_upgrades += 1
        merge_prefix_segment(request)
        return plan

    def num_private_pages(self, request: Request) -> int:
        """Its pages no other request references (what it frees by leaving, or compressing)."""
        refs = self.pool.refs
        return sum(1 for p in request.page_ids if refs(p) == 1)

    def _shared_head(self, request: Request) -> tuple[int, int]:
        """The pages at the head of ``request``'s that a change of kind keeps as they are, and the
        tokens they hold: its prefix in another kind, or else the leading pages other requests share
        with it (sharing is a prefix: whoever shares a page shares the ones before it)."""
        if request.num_prefix_pages:
            return request.num_prefix_pages, request.num_prefix_tokens
        refs, pages, head = self.pool.refs, request.page_ids, 0
        while head < len(pages) and refs(pages[head]) > 1:
            head += 1
        return head, head * self.layout.tokens_per_page(request.kind)

    def _compress_targets(self, request: Request, kind: CacheKind) -> tuple[list[int], int, int, int]:
        """A compression to ``kind``: the pages of its own that it writes, how many free ones more it
        needs, and the pages and tokens of the shared head it keeps."""
        head, start = self._shared_head(request)
        num = self.layout.num_pages_for(max(0, request.num_computed_tokens - start), kind)
        refs = self.pool.refs
        private = [p for p in request.page_ids[head:] if refs(p) == 1][:num]
        return private, num - len(private), head, start

    def compress_gain(self, request: Request, kind: CacheKind) -> tuple[int, int]:
        """(pages of ``kind`` a compression writes, pages it frees): its own pages come free, less those
        its tokens take in ``kind``; a shared head stays (and costs nothing more)."""
        private, short, head, _ = self._compress_targets(request, kind)
        num = len(private) + short
        return num, len(request.page_ids) - head - num

    def can_compress(self, request: Request, kind: CacheKind) -> bool:
        """Whether ``compress`` would find the pages: its own, plus free ones where it has too few."""
        if request.kind is None or request.kind is kind or not can_convert(request.kind, kind):
            return False
        return self.pool.can_allocate(self._compress_targets(request, kind)[1])

    def compress(self, request: Request, kind: CacheKind) -> ConversionPlan | None:
        """Switch a running request's pages to ``kind`` in place, quantising them (kv -> kv-int8,
        hidden -> hidden-int8: ``can_convert``). Its tokens go into the first of the pages only it
        references (the runner reads a layer's tokens before it writes that layer), and the rest come
        back after the step (``release_deferred``)::

            before   [p0 p1 p2 p3 p4 p5 p6]  kv, 16 tokens a page
            after    [p0 p1 p2 p3]           kv-int8, 30 tokens a page; p4-p6 freed after the step

        Pages it shares (a cached prefix) are not rewritten: they stay at its head, in their kind, as
        its prefix segment (``prefix_kind``; the kernels attend over both segments), and only the tokens
        after them change kind. None (nothing changed) where it has too few pages of its own and the
        pool no free ones.
        """
        if request.kind is None or request.kind is kind or not can_convert(request.kind, kind):
            raise ValueError(f"kind: request {request.request_id}'s {getattr(request.kind, 'value', None)} "
                             f"pages cannot be compressed to {kind.value}")
        rid = request.request_id
        private, short, head, start = self._compress_targets(request, kind)
        extra = self.pool.allocate(short, kind, rid) if short > 0 else []
        if extra is None:
            return None
        own = request.page_ids[head:]
        dst = private + extra
        plan = ConversionPlan(rid, request.num_computed_tokens - start, own, dst, request.kind, kind, start)
        self.pool.retag(private, kind, rid)  # they lose their names: their content changes
        kept = set(private)
        rest = [p for p in own if p not in kept]
        if rest:
            self.tables.defer(rest[::-1], rid)
        if head and not request.num_prefix_pages:
            request.prefix_kind, request.num_prefix_pages, request.num_prefix_tokens = request.kind, head, start
        request.kind = request.last_kind = kind
        request.page_ids = request.page_ids[:head] + dst
        # Its pages of ``kind`` are named after the step has written them (``name_computed_pages``): the
        # conversation's next turn finds its history there. They hold its exact K/V (or x) quantised,
        # at least as close to exact as what a request computing in ``kind`` would write itself.
        request.num_named_pages = head
        request.num_compressions += 1
        merge_prefix_segment(request)
        return plan

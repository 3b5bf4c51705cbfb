"""One step's candidates of the adaptive policy as columns, read from the requests once.

Rows: the running requests not yet scheduled this step (``num_running`` of them), then the waiting
requests that may be admitted, each group in queue order. Every later stage (price, choose, admit,
shape the iteration) works on these numpy columns; only scheduling a chosen request touches it again.

Reading is the cost that grows with the queue, so: a field is one C-level pass (``map`` over an
``attrgetter``), never a Python call per request; waiting requests read at the previous decision are
not read again (``WaitingRows``); and the SLO state (pending time, missed or not) is computed from
the timestamps with numpy, mirroring ``Request.pending_time`` / ``has_missed_slo`` (tests hold the
two to the same answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

import numpy as np

from apt_serve_ray.cache.kinds import KINDS, CacheKind
from apt_serve_ray.request import Request
from apt_serve_ray.scheduler.value import importance, urgency

# What is read of every candidate, one float column each (None, no token yet, reads as NaN), then
# num_tokens. One list per column, not a tuple per request: fewer objects for the garbage collector.
_FIELDS = tuple(attrgetter(name) for name in ("arrival_time", "last_token_time", "first_token_time", "gap_allowance",
                                              "ttft_slo_ms", "tbt_slo_ms", "priority", "max_num_tokens"))
_NUM_COLUMNS = len(_FIELDS) + 1
_TOKENS, _PAGES, _COMPUTED, _KIND, _SLOTS = (attrgetter(name) for name in (
    "all_token_ids", "page_ids", "num_computed_tokens", "kind", "swap_slots"))
# The cache kinds in the order of ``Candidates.mem``'s rows and ``held``'s codes: the registry's
# (``cache/kinds.py``: KV first), imported from there.
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}
NO_PAGES = -1  # ``held`` of a request holding no pages (waiting)
_HELD_CODE = {**KIND_CODE, None: NO_PAGES}
NEVER_FITS = np.iinfo(np.int64).max // 4  # pages of a kind whose page cannot hold one token
PREFIX_LOOKUPS = 256  # at most so many waiting requests (from the queue's head) have their prefix looked up
PREFIX_LOOKUPS_MIN = 16  # and at least so many, however full the batch


def _read_columns(requests: list[Request]) -> np.ndarray:
    """``[_NUM_COLUMNS, len(requests)]``: one row per field, one column per request."""
    n = len(requests)
    columns = np.empty((_NUM_COLUMNS, n), dtype=np.float64)
    if n:
        for row, field in zip(columns, _FIELDS):
            row[:] = np.array(list(map(field, requests)), dtype=np.float64)
        columns[-1] = np.fromiter(map(len, map(_TOKENS, requests)), dtype=np.float64, count=n)
    return columns


class WaitingRows:
    """The waiting requests' columns, carried from one decision to the next.

    A queue of thousands of requests is mostly the same from step to step, and reading a cold Python
    object costs far more than copying its column: the columns of requests that were already waiting
    at the previous decision are reused, and only newcomers are read. That is exact because nothing changes
    a request's tokens, timestamps, SLOs or priority while it waits: it gets tokens only by being
    admitted, and a request admitted at one decision is running at the next (or was preempted
    within that decision, before it computed anything). Requests are matched by identity; holding
    them keeps their ids from being reused by new requests.
    """

    def __init__(self) -> None:
        self._requests: list[Request] = []
        self._index: dict[int, int] = {}  # id(request) -> its column
        self._columns = np.empty((_NUM_COLUMNS, 0), dtype=np.float64)

    def read(self, waiting: list[Request]) -> np.ndarray:
        if waiting == self._requests:  # compares identities first: no request is touched
            return self._columns
        n = len(waiting)
        ids = list(map(id, waiting))
        where = np.fromiter(map(self._index.get, ids, repeat(-1)), dtype=np.int64, count=n)
        columns = np.empty((_NUM_COLUMNS, n), dtype=np.float64)
        known = where >= 0
        columns[:, known] = self._columns[:, where[known]]
        new = np.flatnonzero(~known)
        if new.size:
            columns[:, new] = _read_columns([waiting[i] for i in new.tolist()])
        self._requests, self._index, self._columns = waiting, dict(zip(ids, range(n))), columns
        return columns


@dataclass(frozen=True)
class Candidates:
    requests: list[Request]
    num_running: int
    num_tokens: np.ndarray  # known tokens (prompt + generated)
    mem: np.ndarray  # [len(KINDS), n]: pages to hold num_tokens + 1 (this step's token) in each kind
    num_held: np.ndarray  # pages held now (0 for waiting)
    held: np.ndarray  # the kind of the pages held now, as its index in KINDS (NO_PAGES for waiting)
    mem_held: np.ndarray  # pages each needs in the kind it holds now (or its copy in the tier; else KV)
    is_decoding: np.ndarray  # running, has a token, one token left to compute
    num_computed: np.ndarray  # waiting: what a copy in the tier, or the prefix cache (in KV), holds
    arrival: np.ndarray
    pending_s: np.ndarray  # since the last token (since arrival before the first)
    missed: np.ndarray  # can no longer meet its SLO
    tbt_slo_ms: np.ndarray
    urgency: np.ndarray | None  # read only when the value model weighs it
    importance: np.ndarray | None
    priority: np.ndarray | None = None  # the requests' priority values (lower is more important)
    # Waiting requests whose computed tokens wait in the tier below memory: the kind of that copy
    # (as in ``held``; NO_PAGES for the others). Their ``num_computed`` is what the copy holds.
    copy: np.ndarray | None = None
    # Waiting requests that found a cached prefix: the kind that holds it, as in ``held`` (NO_PAGES:
    # none, or not looked up); their ``num_computed`` is what it holds. None: no waiting request found one.
    hit_kind: np.ndarray | None = None
    ttft_slo_ms: np.ndarray | None = None
    max_num_tokens: np.ndarray | None = None  # tokens each holds when it finishes (at most)
    awaiting_first: np.ndarray | None = None  # no first token yet (its TTFT still open)
    # Seconds until its next token is late: the TTFT left before the first, the gap allowance left after
    # (negative once missed). What a preempted request has to come back within and still pass.
    promise_left_s: np.ndarray | None = None

    @property
    def num(self) -> int:
        return len(self.requests)

    @property
    def mem_kv(self) -> np.ndarray:
        return self.mem[0]

    @property
    def mem_hidden(self) -> np.ndarray:
        return self.mem[1]

    @property
    def is_hidden(self) -> np.ndarray:
        """Holds hidden (full-precision) pages now."""
        return self.held == 1

    @property
    def is_compressed(self) -> np.ndarray:
        """Holds pages of a compressed kind now."""
        return self.held > 0

    @property
    def current(self) -> np.ndarray:
        """The kind of what each request holds, as in ``held``: its pages, or its copy in the tier."""
        return self.held if self.copy is None else np.where(self.copy >= 0, self.copy, self.held)

    @property
    def need(self) -> np.ndarray:
        """Tokens each request holds after this step's token."""
        return self.num_tokens + 1

    @classmethod
    def gather(cls, ctx, waiting_rows: WaitingRows | None = None, *, with_urgency: bool = False,
               with_importance: bool = False) -> Candidates | None:
        """Read the candidates of ``ctx`` (a ``SchedulingContext``); None when there are none. With
        ``waiting_rows`` (kept by the caller across decisions), waiting requests seen before are not read."""
        running = list(ctx.running)
        if ctx.num_scheduled:
            running = [r for r in running if not ctx.is_scheduled(r)]
        waiting = list(ctx.waiting)
        if not ctx.is_admission_open:
            waiting = [r for r in waiting if ctx.can_admit(r)]
        requests = running + waiting
        n, n_run = len(requests), len(running)
        if not n:
            return None
        now = ctx.now
        lay = ctx.cache.layout
        columns = np.concatenate((_read_columns(running), waiting_rows.read(waiting) if waiting_rows is not None
                                  else _read_columns(waiting)), axis=1)
        arrival, last, first, allowance, ttft_ms, tbt_ms, priority, max_tokens, tokens = columns
        num_tokens = tokens.astype(np.int64)
        need = num_tokens + 1
        mem = np.empty((len(KINDS), n), dtype=np.int64)
        for row, kind in zip(mem, KINDS):
            tpp = lay.tokens_per_page(kind)
            row[:] = -(-need // tpp) if tpp > 0 else NEVER_FITS
        # Request.pending_time and Request.has_missed_slo, for all rows at once (comparisons with NaN,
        # no token yet, are False, as the scalar code's branches).
        no_token = np.isnan(last)
        pending_s = np.maximum(0.0, now - np.where(no_token, arrival, last))
        ttft_s, tbt_s = ttft_ms / 1000.0, tbt_ms / 1000.0
        with np.errstate(invalid="ignore"):
            missed = np.where(np.isnan(first), now - arrival > ttft_s,
                              (first - arrival > ttft_s) | (allowance < 0) | (now - last > allowance))

        num_held = np.zeros(n, dtype=np.int64)
        held = np.full(n, NO_PAGES, dtype=np.int64)
        num_computed = np.zeros(n, dtype=np.int64)
        mem_held = mem[0].copy()
        if n_run:
            num_held[:n_run] = np.fromiter(map(len, map(_PAGES, running)), dtype=np.int64, count=n_run)
            held[:n_run] = np.fromiter(map(_HELD_CODE.__getitem__, map(_KIND, running)), dtype=np.int64, count=n_run)
            mem_held[:n_run] = mem[np.maximum(held[:n_run], 0), np.arange(n_run)]
            num_computed[:n_run] = np.fromiter(map(_COMPUTED, running), dtype=np.int64, count=n_run)
            for i, r in enumerate(running):
                if r.num_prefix_pages:  # a shared prefix kept in another kind: the rest in each kind
                    for k, kind in enumerate(KINDS):
                        if mem[k, i] != NEVER_FITS:
                            mem[k, i] = ctx.cache.num_pages_for(r, int(need[i]), kind)
                    mem_held[i] = mem[held[i], i]
        copy = None
        if waiting and ctx.cache.holds_request_copies():
            # Read live, not carried in WaitingRows: a request admitted and preempted within one
            # decision may come back without its copy. One C-level pass; the swapped are few.
            swapped = np.flatnonzero(np.fromiter(map(len, map(_SLOTS, waiting)), dtype=np.int64, count=len(waiting)))
            if swapped.size:
                copy = np.full(n, NO_PAGES, dtype=np.int64)
                rows = swapped + n_run
                copy[rows] = [_HELD_CODE[waiting[i].kind] for i in swapped.tolist()]
                num_computed[rows] = [waiting[i].num_computed_tokens for i in swapped.tolist()]
                mem_held[rows] = mem[copy[rows], rows]
        hit_kind = None
        if waiting and ctx.cache.prefix_caching:
            # What the prefix cache holds of the first waiting requests, in the kind that holds the most
            # of it (KV on ties; each kind caches its own pages): computed already, and pages other
            # requests use cost no free page in that kind. Further back the queue they are charged in
            # full (the lookup is a Python call per request). Only as far back as the step could
            # reach: twice the sequences it has left after the running ones (at least a few), at most
            # PREFIX_LOOKUPS (256 lookups in every kind were most of a decision with 1,600 waiting).
            kinds = [CacheKind.KV, *ctx.compressed_kinds]
            reach = min(PREFIX_LOOKUPS, max(PREFIX_LOOKUPS_MIN, 2 * (ctx.num_seqs_left - n_run)))
            for i, r in enumerate(waiting[:reach]):
                row = n_run + i
                if copy is not None and copy[row] >= 0:
                    continue
                tokens, shared, extra, kind = max(((*ctx.prefix_hit(r, k), k) for k in kinds), key=lambda t: t[0])
                if tokens:
                    if hit_kind is None:
                        hit_kind = np.full(n, NO_PAGES, dtype=np.int64)
                    code = KIND_CODE[kind]
                    hit_kind[row] = code
                    num_computed[row] = tokens
                    mem[code, row] = max(0, mem[code, row] + extra - shared)
                    mem_held[row] = mem[0, row]
        is_decoding = np.zeros(n, dtype=bool)
        is_decoding[:n_run] = ~np.isnan(first[:n_run]) & (num_tokens[:n_run] - num_computed[:n_run] == 1)

        urg = imp = None
        if with_urgency:  # the next deadline: the first token's, then the next gap's (Request.deadline)
            deadline = np.where(no_token, arrival + ttft_s, last + tbt_s)
            urg = urgency(now, deadline, np.where(no_token, ttft_ms, tbt_ms) / 1000.0)
        if with_importance:
            imp = importance(priority)
        promise_left = np.where(no_token, ttft_s, allowance) - pending_s
        return cls(requests, n_run, num_tokens, mem, num_held, held, mem_held, is_decoding, num_computed,
                   arrival, pending_s, missed, tbt_ms, urg, imp, priority, copy, hit_kind, ttft_ms,
                   max_tokens.astype(np.int64), np.isnan(first), promise_left)

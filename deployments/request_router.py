"""FitAwareRequestRouter: Serve's request router for the engine replicas, choosing where a request fits.

For each ``generate`` call (an ``EngineRequest``) it estimates the pages the request will hold (its
prompt plus up to ``output_horizon_tokens`` of output, in KV pages: the most it can need) and each
replica's free pages: the replica's last ``record_routing_stats`` snapshot (a ``LoadReport``: free
pages, less the prompt pages of requests it has received but not yet prefilled) minus what this
router has sent there since that snapshot was taken (Serve refreshes stats only every
``request_routing_stats_period_s``)::

    est_free = stats.num_free_pages - stats.num_pending_pages
               - sum(pages of requests routed here that the snapshot does not count yet)

A request enters that ledger when it is ranked (requests routed at the same moment must see each
other, or they all pick the same replica) and moves if Serve sends it elsewhere. Entries leave when a
snapshot covers them, not when Serve reports the call done: a finished request is counted for at most
one stats period (a cautious error), and completion callbacks can fire early for streams. A snapshot
covers a request when it lists it among those the replica received (``LoadReport.received``); the
time it was taken is not enough: on a busy host a call can be on its way for longer than any fixed
margin, and a snapshot taken meanwhile counts it nowhere (CI saw two requests sent to a full replica).

Replicas where the request fits come first, least loaded after placement first, where load is the
larger of page usage and the share of ``max_num_seqs`` taken; among them, the ones the controller
marked pressured (``LoadReport.is_pressured``: their own memory is past the heavy watermark) go after the others, so new work flows to the replicas with room while any has
it; the replicas where it does not fit follow by free pages. Each
replica is its own rank, so Serve takes our first choice unless that replica's queue is full.
Calls that are not ``generate`` (control, load) are left to Serve's usual choice, except that a call
with a ``replica_id`` keyword goes to that replica only (debug reads such as ``memory_timeline``, and
``generate`` calls pinned by tests and load tools).

Prefix affinity (``prefix_affinity.py``): the router remembers the prompt pages it sent to each replica
and the conversation (``session_id``) each replica serves. A request's pages that a replica probably
holds cost it no free page there; and the request goes to the replica of its session, or else to the one
holding the longest prefix of its prompt (at least ``MIN_MATCH_SHARE`` of its pages), when that replica
is in the first group above (fits, not pressured) and its load after placement is within
``affinity_slack`` of the least loaded one's: reuse wins over balance only while balance costs little
(Ray Serve LLM's prefix-aware router applies the same rule with queue lengths).

LoRA adapters (``adapter_affinity``, on by default; Ray Serve's model multiplexing does the same by model
id): a replica holds an adapter in one of its ``max_loras`` slots (``LoadReport.loras``, or a request of
that adapter was routed there since its snapshot). A request that names an adapter, when no prefix or
session pulls it, goes to the least loaded replica of the first group that holds its adapter, else to one
with a free slot, else to one with a slot no request holds (the engine loads the adapter there, in the
least recently used such slot), each within ``affinity_slack`` of the least loaded; and never to a
replica whose every slot requests hold (there it would wait for one to end) while another has room.
Adapters' prompts are named apart in the prefix index (``EngineRequest.prefix_salt``).
"""

from __future__ import annotations

import math
import random

import numpy as np
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.prefix_affinity import process_index
from deployments.wire import RECEIVED_WINDOW_S, EngineRequest, LoadReport

IN_TRANSIT_S = 0.05  # a request routed this long before a snapshot may not have reached the replica yet
OUTPUT_HORIZON_TOKENS = 256  # default: output tokens a request is assumed to reach (max_tokens caps it)
AFFINITY_SLACK = 0.25  # load after placement a replica holding the prefix may exceed the least loaded's by
MIN_MATCH_SHARE = 0.1  # of a prompt's pages: a shorter match does not pull a request off the least loaded
HOLDS, FREE_SLOT, IDLE_SLOT, MUST_WAIT = range(4)  # a replica, for a request's LoRA adapter (adapter_state)


def request_pages(request: EngineRequest, tokens_per_page: int, horizon: int) -> int:
    """Pages a request will hold with a KV cache: prompt plus (capped) output."""
    num_output = request.max_tokens or horizon
    return math.ceil((request.num_prompt_tokens + min(num_output, horizon)) / tokens_per_page)


class FitAwareRequestRouter(RequestRouter):
    def initialize_state(self, output_horizon_tokens: int = OUTPUT_HORIZON_TOKENS,
                         default_tokens_per_page: int = 16, affinity_slack: float = AFFINITY_SLACK,
                         adapter_affinity: bool = True) -> None:
        self.horizon = output_horizon_tokens
        self.default_tokens_per_page = default_tokens_per_page
        self.affinity_slack = affinity_slack
        self.adapter_affinity = adapter_affinity
        self.adapter_routes: dict[ReplicaID, dict[str, float]] = {}  # replica -> {adapter: when routed there}
        self.routed: dict[ReplicaID, dict[str, tuple[float, int]]] = {}  # replica -> {request: (at, pages)}
        self._where: dict[str, ReplicaID] = {}  # request -> the replica whose ledger holds it
        # Per replica (by ``unique_id``: a ``ReplicaID`` hashes in Python): its last snapshot and what ranking
        # reads of it (``_snapshot``), and its ledger's [pages, requests] (kept as entries come and go:
        # ranking reads them for every replica on every request).
        self._snapshots: dict[str, tuple[dict, tuple | None]] = {}
        self._since: dict[str, list[int]] = {}
        self.prefixes = process_index(default_tokens_per_page)  # the router's admission reads it too

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        pinned = pending_request is not None and (pending_request.kwargs or {}).get("replica_id")
        if pinned:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        request = _generate_request(pending_request)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy loop when every queue is full
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        hashes = self.prefixes.block_hashes(request.prompt, request.prefix_salt)
        matched = self.prefixes.matches(hashes)
        ranked, keys = self._rank(candidate_replicas, request, matched)
        pick = self._affinity(ranked, keys, matched, len(hashes), request.session_id)
        if pick is None and request.lora_name is not None and self.adapter_affinity:
            pick = self._adapter_pick(ranked, keys, request.lora_name)
        if pick is not None:
            ranked.insert(0, ranked.pop(pick))
        self._record(pending_request, ranked[0].replica_id, request)
        self.prefixes.record(ranked[0].replica_id, hashes, request.session_id)
        return [[r] for r in ranked]

    def _rank(self, candidates: list[RunningReplica], request: EngineRequest,
              matched: dict) -> tuple[list[RunningReplica], list[tuple]]:
        """The candidates in ``rank_key`` order, and their keys' first two fields in that order. Where
        every candidate has a snapshot of one page size (the usual case) the keys are computed as arrays:
        at 256 replicas a key per replica in Python cost ~1.3 ms a request (``benchmarks/fleet_sim.py
        router``). Both paths round the load alike (``test_serve_request_router.py`` holds them together)."""
        snaps = [self._snapshot(r) for r in candidates]
        sizes = {b[4] for b in snaps if b is not None}
        if len(sizes) != 1 or any(b is None for b in snaps):  # a new replica, or models of two page sizes
            need = {size: request_pages(request, size, self.horizon) for size in sizes}
            rows = sorted((self._key(r, b, need[b[4]] if b is not None else 0,
                                     matched.get(r.replica_id, 0) if matched else 0), i)
                          for i, (r, b) in enumerate(zip(candidates, snaps)))
            return [candidates[i] for _, i in rows], [key[:2] for key, _ in rows]
        free, seqs, pages, max_seqs, _, pressured = np.array(snaps, dtype=np.float64).T
        since = np.array([self._since.get(r.replica_id.unique_id) or (0, 0) for r in candidates], dtype=np.float64)
        cached = np.array([matched.get(r.replica_id, 0) for r in candidates]) if matched else 0
        need = np.maximum(0, request_pages(request, sizes.pop(), self.horizon) - cached)
        free = free - since[:, 0]
        fits = need <= free
        load_after = np.maximum(1 - (free - need) / pages, (seqs + since[:, 1] + 1) / max_seqs)
        group = np.where(fits, pressured, 2.0)
        second = np.where(fits, np.floor(load_after * 1000 + 0.5) / 1000, -free)  # the rounding ``_key`` does
        lengths = self.replica_queue_len_cache  # Serve's (filled on every send where it is on, the default)
        queue = np.array([lengths.get(r.replica_id) or 0 for r in candidates])
        order = np.lexsort((np.random.random(len(candidates)), queue, second, group))
        return [candidates[i] for i in order], list(zip(group[order].tolist(), second[order].tolist()))

    def _affinity(self, ranked: list[RunningReplica], keys: list[tuple], matched: dict, num_blocks: int,
                  session: str | None) -> int | None:
        """Where in ``ranked`` the replica of the request's session is, else the one holding the longest
        prefix of it, if it is in the best group and loaded at most ``affinity_slack`` more than the
        first (see above); None for the first."""
        best = keys[0]
        home = self.prefixes.session_replica(session)
        candidates = [i for i, r in enumerate(ranked) if r.replica_id == home] if home is not None else []
        if not candidates and num_blocks and matched:
            longest = max((matched.get(r.replica_id, 0) for r in ranked), default=0)
            if longest >= max(1, MIN_MATCH_SHARE * num_blocks):
                candidates = [i for i, r in enumerate(ranked) if matched.get(r.replica_id, 0) == longest]
        for i in candidates:
            if keys[i][0] == best[0] and keys[i][1] <= best[1] + self.affinity_slack:
                return i
        return None

    def _adapter_pick(self, ranked: list[RunningReplica], keys: list[tuple], name: str) -> int | None:
        """Where in ``ranked`` the replica for a request of adapter ``name`` is (see above), or None for the
        usual first choice."""
        best = keys[0]
        group = [i for i in range(len(ranked)) if keys[i][0] == best[0]]
        states = {i: self.adapter_state(ranked[i], name) for i in group}
        for state in (HOLDS, FREE_SLOT, IDLE_SLOT):
            for i in group:
                if states[i] == state and keys[i][1] <= best[1] + self.affinity_slack:
                    return i
        if states[0] == MUST_WAIT:
            return min(group, key=lambda i: states[i])  # ranked order breaks ties: least loaded
        return None

    def adapter_state(self, replica: RunningReplica, name: str) -> int:
        """HOLDS, FREE_SLOT, IDLE_SLOT or MUST_WAIT: what a request of adapter ``name`` finds there."""
        stats = _load_report(replica)
        if stats is None:
            return FREE_SLOT  # no snapshot yet
        since = {n for n, t in self.adapter_routes.get(replica.replica_id, {}).items() if t > stats.time - IN_TRANSIT_S}
        held = set(stats.loras) | since
        if name in held:
            return HOLDS
        if len(held) < stats.max_loras:
            return FREE_SLOT
        return IDLE_SLOT if set(stats.loras) - set(stats.busy_loras) - since else MUST_WAIT

    def rank_key(self, replica: RunningReplica, request: EngineRequest, cached_pages: int = 0) -> tuple:
        """``cached_pages``: pages of its prompt the replica probably holds already (no free page needed)."""
        base = self._snapshot(replica)
        need = request_pages(request, base[4], self.horizon) if base is not None else 0
        return self._key(replica, base, need, cached_pages)

    def _key(self, replica: RunningReplica, base: tuple | None, need: int, cached_pages: int) -> tuple:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id) or 0
        if base is None:  # no snapshot yet (a new replica): neither preferred nor avoided
            return (0, 0.5, queue_len, random.random())
        free, num_seqs, num_pages, max_num_seqs, _, pressured = base
        since_pages, since_requests = self._since.get(replica.replica_id.unique_id) or (0, 0)
        need = max(0, need - cached_pages)
        free -= since_pages
        if need > free:
            return (2, -free, queue_len, random.random())
        load_after = max(1 - (free - need) / num_pages, (num_seqs + since_requests + 1) / max_num_seqs)
        return (1 if pressured else 0, math.floor(load_after * 1000 + 0.5) / 1000, queue_len, random.random())

    def _snapshot(self, replica: RunningReplica) -> tuple | None:
        """``(free pages less pending, sequences, pages, max_num_seqs, tokens per page, pressured)`` of the
        replica's last snapshot (None: none yet), read once per snapshot: a request ranks every replica,
        and at 256 replicas reading each report and its ledger again per request cost 2-3 ms a request.
        On a new snapshot the replica's ledger forgets what it covers: a snapshot that lists what the
        replica received covers those (and, after ``RECEIVED_WINDOW_S``, any that never arrived); one
        that does not, everything routed ``IN_TRANSIT_S`` before it. (A request routed after a snapshot
        is never covered by it.)"""
        replica_id, data = replica.replica_id, replica.routing_stats
        cached = self._snapshots.get(replica_id.unique_id)
        if cached is not None and cached[0] is data:
            return cached[1]
        stats = LoadReport.from_dict(data) if data else None
        base = None
        if stats is not None:
            if stats.received is None:
                covered = lambda rid, t: t <= stats.time - IN_TRANSIT_S  # noqa: E731
            else:
                received = set(stats.received)
                covered = lambda rid, t: rid in received or t <= stats.time - RECEIVED_WINDOW_S  # noqa: E731
            for rid in [rid for rid, (t, _) in self.routed.get(replica_id, {}).items() if covered(rid, t)]:
                self._forget(rid)
            base = (stats.num_free_pages - stats.num_pending_pages, stats.num_running + stats.num_waiting,
                    stats.num_pages, stats.max_num_seqs, stats.tokens_per_kv_page, stats.is_pressured)
        self._snapshots[replica_id.unique_id] = (data, base)
        return base

    def _forget(self, key: str) -> tuple[float, int] | None:
        """Take request ``key`` out of the ledger it is in; its entry, or None."""
        replica_id = self._where.pop(key, None)
        entry = self.routed.get(replica_id, {}).pop(key, None) if replica_id is not None else None
        if entry is not None:
            since = self._since[replica_id.unique_id]
            since[0] -= entry[1]
            since[1] -= 1
        return entry

    def _record(self, pending_request: PendingRequest, replica_id: ReplicaID, request: EngineRequest) -> None:
        key = pending_request.metadata.internal_request_id
        entry = self._forget(key)
        if entry is None:
            snapshot = self._snapshots.get(replica_id.unique_id)
            base = snapshot[1] if snapshot is not None else None
            tokens_per_page = base[4] if base is not None else self.default_tokens_per_page
            entry = (self._get_curr_time_s(), request_pages(request, tokens_per_page, self.horizon))
        self.routed.setdefault(replica_id, {})[key] = entry
        self._where[key] = replica_id
        since = self._since.setdefault(replica_id.unique_id, [0, 0])
        since[0] += entry[1]
        since[1] += 1
        if request.lora_name is not None:
            self.adapter_routes.setdefault(replica_id, {})[request.lora_name] = self._get_curr_time_s()

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = _generate_request(pending_request)
        if request is not None:
            self._record(pending_request, replica_id, request)  # where it went, if not our first choice

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """Serve's new set of replicas: what this router kept about the ones gone (a scale-down drains a
        replica without ``on_replica_actor_died``) goes with them."""
        keep = {r.replica_id for r in replicas}
        for replica_id in [r for r in self.curr_replicas if r not in keep]:
            self._drop(replica_id)
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._drop(replica_id)
        super().on_replica_actor_died(replica_id)

    def _drop(self, replica_id: ReplicaID) -> None:
        for key in list(self.routed.pop(replica_id, {})):
            self._where.pop(key, None)
        self._since.pop(replica_id.unique_id, None)
        self._snapshots.pop(replica_id.unique_id, None)
        self.adapter_routes.pop(replica_id, None)
        self.prefixes.forget(replica_id)


def _generate_request(pending_request: Optional[PendingRequest]) -> EngineRequest | None:
    """The request of a ``generate`` call whose size is known (a tokenised prompt), else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate" or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, EngineRequest) and request.num_prompt_tokens is not None else None


def _load_report(replica: RunningReplica) -> LoadReport | None:
    """The replica's last snapshot (Serve keeps it as the dict ``record_routing_stats`` returned)."""
    return LoadReport.from_dict(replica.routing_stats) if replica.routing_stats else None

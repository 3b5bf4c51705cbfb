"""What each replica's prefix cache probably holds, as the request router sees it: the pages of the
prompts it sent there, and the conversations (sessions) each replica serves.

Ray Serve LLM's prefix-aware router keeps a prefix tree of the text it routed per replica; we keep the
same idea on token ids, in the engine's own unit: a prompt's full KV pages (``block_tokens`` tokens),
each named by a hash chain over its tokens, as the engine names them (``CacheManager.block_hashes``;
a cheaper hash here, only ever compared within this router). A replica "matches" a request by the
leading pages of its prompt that were sent there. The index forgets least recently used pages first
beyond ``max_blocks`` per replica, and does not see the engine's evictions: a match is a good guess,
not a promise (the engine finds what it really holds).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class PrefixIndex:
    def __init__(self, block_tokens: int = 16, max_blocks: int = 200_000, max_sessions: int = 100_000) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}
        self._sessions: OrderedDict[str, Hashable] = OrderedDict()

    def block_hashes(self, tokens: list[int], salt: Hashable | None = None) -> list[int]:
        """Names of the full pages of ``tokens``: each hashes its parent's name and its tokens (the
        first, the request's ``cache_salt`` and adapter too, as the engine's names do)."""
        size, out, parent = self.block_tokens, [], (0 if salt is None else hash(salt))
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start:start + size])))
            out.append(parent)
        return out

    def match(self, replica: Hashable, hashes: list[int]) -> int:
        """Leading pages of ``hashes`` sent to ``replica`` (and not forgotten)."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def matches(self, hashes: list[int]) -> dict[Hashable, int]:
        """``match`` for every replica holding the first page (the others match nothing)."""
        if not hashes:
            return {}
        first = hashes[0]
        return {replica: self.match(replica, hashes) for replica, blocks in self._blocks.items() if first in blocks}

    def session_replica(self, session: str | None) -> Hashable | None:
        return self._sessions.get(session) if session else None

    def record(self, replica: Hashable, hashes: list[int], session: str | None = None) -> None:
        """``replica`` got a request with these pages (it will hold them once it has computed them)."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        if session:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica went away: what it held is gone, and its sessions go elsewhere."""
        self._blocks.pop(replica, None)
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]

    def num_blocks(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))


_PROCESS_INDEX: PrefixIndex | None = None


def process_index(block_tokens: int = 16) -> PrefixIndex:
    """The index of this process: the request router records into it, and the router's admission
    reads it (``fits_beside_cached_prefix``). One per process (the Router replica's)."""
    global _PROCESS_INDEX
    if _PROCESS_INDEX is None:
        _PROCESS_INDEX = PrefixIndex(block_tokens)
    return _PROCESS_INDEX


def fits_beside_cached_prefix(index: PrefixIndex | None, reports, prompt: list[int], num_pages: int,
                              salt: Hashable | None = None) -> bool:
    """Whether a replica probably holds this prompt's leading pages and has free pages for the rest
    of the request (``num_pages`` with its whole prompt): then admitting it costs only those, however
    full the cluster is. ``reports``: the replicas' ``LoadReport``s (their ``replica_id`` is the
    index's key's ``unique_id``)."""
    if index is None or not prompt or not isinstance(prompt, list):
        return False
    hashes = index.block_hashes(prompt, salt)
    if not hashes:
        return False
    by_id = {getattr(key, "unique_id", key): key for key in index._blocks}
    for report in reports:
        key = by_id.get(report.replica_id)
        if key is None:
            continue
        matched = index.match(key, hashes)
        if matched and num_pages - matched <= report.num_free_pages - report.num_pending_pages:
            return True
    return False

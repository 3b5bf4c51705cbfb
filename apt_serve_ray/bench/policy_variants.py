"""The policy variants benchmarks compare, by name: the scheduling policy and the cache kinds each runs with.

``fcfs`` (vLLM 0.5), ``sarathi`` (vLLM v1 / Sarathi-Serve), ``priority``: KV pages only. ``apt`` / ``apt-kv``:
the adaptive policy with cache_ratio 0 (the ceiling admits no compressed page; ``apt`` keeps the hidden
kind offered, so a controller may raise the ceiling); ``apt-hidden[@R]``: the paper's hybrid cache, KV and
hidden pages under the ceiling R (default 0.5); ``apt-all[@R]``: every compressed kind under R;
``sarathi-int8[@R]``: sarathi giving new requests kv-int8 pages while under R.
"""

from __future__ import annotations

ALL_KINDS = ("hidden", "kv-int8", "hidden-int8")
BASES = ("fcfs", "sarathi", "priority", "apt", "apt-kv", "apt-hidden", "apt-all", "sarathi-int8")
RATIOED = ("apt-hidden", "apt-all", "sarathi-int8")


def cache_options(name: str) -> dict:
    """``EngineConfig`` fields of the variant ``name`` (see above)."""
    base, at, ratio = name.partition("@")
    if base not in BASES or at and base not in RATIOED:
        raise ValueError(f"policy: unknown variant {name!r}; valid: {list(BASES)} ({', '.join(RATIOED)} take @RATIO)")
    if base == "apt-all":
        return dict(cache_kinds=ALL_KINDS, cache_ratio=float(ratio or 0.5))
    if base == "apt-hidden":
        return dict(cache_kinds=("hidden",), cache_ratio=float(ratio or 0.5))
    if base == "sarathi-int8":
        return dict(cache_kinds=("kv-int8",), cache_ratio=float(ratio or 0.5))
    return dict(cache_ratio=0.0, enable_hybrid_cache=name == "apt")


def policy_of(name: str) -> str:
    """The scheduling policy's registered name."""
    return "apt" if name.startswith("apt") else name.partition("@")[0].removesuffix("-int8")

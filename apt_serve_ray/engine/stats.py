"""What the engine publishes about itself: one step (``StepStats``) and the cache with its queues
(``CacheStats``, gathered by ``collect_cache_stats``).

These are the contract with everything that watches the engine: observers (metrics, the memory
timeline), the async engine and the engine process (which sends them to its parent every step, so
they pickle), the benchmark driver. A field is the contract: adding one is compatible, renaming or
removing one is a change every reader sees (the Serve replica builds its ``LoadReport`` from these).
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_serve_ray.cache.kinds import CacheKind


@dataclass(frozen=True)
class CacheStats:
    """The page pool and the queues between two steps (``LLMEngine.cache_stats()``)."""

    num_pages: int
    num_free_pages: int
    num_kv_pages: int  # in use, by kind
    num_hidden_pages: int
    num_kv_tokens: int  # computed tokens held in those pages
    num_hidden_tokens: int
    usage: float  # share of the pool in use
    cache_ratio: float  # the ceiling of the share of the pool in compressed kinds
    hidden_share: float  # the measured share of hidden pages (hidden, hidden-int8) among used ones
    num_waiting: int
    num_running: int
    num_preemptions: int  # since the engine started
    admission_open: bool  # new requests are admitted (operator / controller and heavy watermark agree)
    # The geometry: fixed for the engine's life.
    hidden_supported: bool  # a hidden page holds more tokens than a KV page for this model
    hidden_allowed: bool  # the engine may use the hidden kind (supported or forced, and switched on)
    hidden_ratio: float  # bytes of the hidden cache per byte of the KV cache
    bytes_per_page: int
    kv_bytes_per_token: int
    hidden_bytes_per_token: int
    kv_tokens_per_page: int
    hidden_tokens_per_page: int
    # Every kind ("kv", "hidden", "kv-int8", "hidden-int8"): pages in use, tokens held, tokens per page.
    pages_by_kind: dict[str, int] | None = None
    tokens_by_kind: dict[str, int] | None = None
    tokens_per_page_by_kind: dict[str, int] | None = None
    compressed_kinds: tuple[str, ...] = ()  # offered by this engine, cheapest per step first
    compressed_share: float = 0.0  # share of the used pages in compressed kinds
    # The tier below memory (``swap_space``): slots of one page each, in total and in use by requests; preemptions
    # that kept their pages there since the engine started (the rest of num_preemptions recompute).
    num_swap_slots: int = 0
    num_used_swap_slots: int = 0
    num_swap_outs: int = 0
    # The largest priority value (the least important) among running requests: an arrival of a smaller
    # value may displace it (apt's priority preemption), so memory that is full is not full for it.
    max_running_priority: int | None = None
    # Prefix caching: pages nobody references kept for a later hit (part of num_free_pages), by kind;
    # tokens looked up at admission and found, by kind, since the engine started; pages evicted.
    num_cached_pages: int = 0
    cached_pages_by_kind: dict[str, int] | None = None
    prefix_query_tokens: dict[str, int] | None = None
    prefix_hit_tokens: dict[str, int] | None = None
    num_prefix_evictions: int = 0
    # Cached pages demoted to the tier below memory (their slots count as free for preempted requests,
    # not in num_used_swap_slots), and tokens found there since the start, by kind.
    num_tier_cached_pages: int = 0
    prefix_tier_hit_tokens: dict[str, int] | None = None
    # LoRA adapters: (those in a slot now, those of them requests in the engine hold); the request router
    # sends a request to a replica that holds its adapter.
    loras: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens found in the prefix cache per token looked up at admission, since the start."""
        queries = sum((self.prefix_query_tokens or {}).values())
        return sum((self.prefix_hit_tokens or {}).values()) / queries if queries else 0.0


@dataclass(frozen=True)
class StepStats:
    """One step that ran something (``LLMEngine.last_step``; None after a step with nothing to run)."""

    schedule_s: float  # the scheduling decision, wall time (also under the simulator: what it costs)
    execute_s: float  # the model runner (upgrades, forward, sampling), on the engine's clock
    total_s: float  # the whole step (upkeep, schedule, execute, outputs), on the engine's clock
    num_tokens: int  # tokens computed this step
    num_seqs: int  # requests in the batch
    num_upgrades: int  # hidden -> KV upgrades run before the forward pass
    preempt_causes: tuple[str, ...]  # one per request preempted this step: "memory" or "policy"
    cache: CacheStats  # after the step: finished requests' pages are back
    num_swap_outs: int = 0  # preemptions this step that kept their pages in the tier below memory
    num_swap_ins: int = 0  # requests whose pages came back from it this step
    # What the step was made of, to explain a long one: rows that sampled their next token after one
    # token of compute (decodes), prefill tokens (the rest), in-place compressions to int8 kinds.
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    num_compressions: int = 0
    # The policy's step-time model for this step's chunks, plus what it priced its kind changes and
    # transfers at (None: a policy without a model).
    predicted_s: float | None = None

    def as_record(self) -> dict:
        """What the step was made of and took, as plain numbers (the memory timeline's samples and
        the benchmark driver's step records carry it, to explain a long gap)."""
        return {"step_s": round(self.total_s, 6), "schedule_s": round(self.schedule_s, 6),
                "execute_s": round(self.execute_s, 6),
                "predicted_s": None if self.predicted_s is None else round(self.predicted_s, 6),
                "decodes": self.num_decodes, "prefill_tokens": self.num_prefill_tokens, "seqs": self.num_seqs,
                "upgrades": self.num_upgrades, "compressions": self.num_compressions,
                "swap_outs": self.num_swap_outs, "swap_ins": self.num_swap_ins,
                "preemptions": len(self.preempt_causes)}


def collect_cache_stats(cache, sched, swap, *, num_lora_waiting: int, hidden_allowed: bool, loras,
                        **geometry) -> CacheStats:
    """``LLMEngine.cache_stats()``: the pool (``cache``: its ``CacheManager``), the scheduler's queues and
    knobs, the swap tier (or None), and ``geometry``, the fixed part the engine works out once."""
    pool = cache.pool
    # Only running requests hold pages (preemption frees them all and zeroes num_computed_tokens), and
    # this runs every step: the waiting queue, thousands long under overload, is not walked.
    tokens = cache.num_cached_tokens(sched.running)
    return CacheStats(
        num_pages=pool.num_pages, num_free_pages=pool.num_free_pages,
        num_kv_pages=pool.num_used(CacheKind.KV), num_hidden_pages=pool.num_used(CacheKind.HIDDEN),
        num_kv_tokens=tokens[CacheKind.KV.value], num_hidden_tokens=tokens[CacheKind.HIDDEN.value],
        usage=pool.usage(), cache_ratio=sched.cache_ratio, hidden_share=sched.hidden_share(),
        pages_by_kind={k.value: pool.num_used(k) for k in CacheKind}, tokens_by_kind=tokens,
        compressed_share=sched.compressed_share(),
        num_waiting=len(sched.waiting) + num_lora_waiting, num_running=len(sched.running),
        num_preemptions=sched.num_preemptions,
        num_swap_slots=swap.num_slots if swap else 0,
        num_used_swap_slots=swap.num_used_slots - cache.num_tier_pages if swap else 0,
        num_swap_outs=sched.num_swap_outs, num_tier_cached_pages=cache.num_tier_pages,
        admission_open=sched.admission_open and sched.pressure_admit, hidden_allowed=hidden_allowed,
        max_running_priority=max((r.priority for r in sched.running), default=None),
        num_cached_pages=pool.num_cached_free_pages,
        cached_pages_by_kind={k.value: pool.num_cached(k) for k in CacheKind},
        prefix_query_tokens=dict(cache.prefix_stats.queries), prefix_hit_tokens=dict(cache.prefix_stats.hits),
        num_prefix_evictions=pool.num_evictions,
        prefix_tier_hit_tokens=dict(cache.prefix_stats.tier_hits),
        loras=loras,
        **geometry,
    )

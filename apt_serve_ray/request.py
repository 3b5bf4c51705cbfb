"""A request as the engine tracks it: tokens, progress, cache pages, SLO targets and timestamps.

One token model (as in vLLM v1): a request has ``num_tokens`` known tokens (prompt + generated) and
``num_computed_tokens`` of them in its cache. Every step the scheduler lets ``num_computed_tokens``
catch up; when it reaches ``num_tokens`` the step samples one more token. Prefill, chunked prefill,
decode and recompute after preemption are all the same thing seen from here.
"""

from __future__ import annotations

import enum
import itertools
import time

from apt_serve_ray.cache.kinds import CacheKind  # the public name of a cache kind (defined with its spec)
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.gap_budget import GapBudget


_arrival_order = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        max_total_tokens: int,
        ttft_slo_ms: float,
        tbt_slo_ms: float,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
        service_class: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.seq = next(_arrival_order)  # breaks arrival-time ties in FCFS order
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.ttft_slo_ms = ttft_slo_ms
        self.tbt_slo_ms = tbt_slo_ms
        self.priority = priority
        self.trace_context = trace_context  # the caller's tracing context (W3C carrier), if any
        self.service_class = service_class  # the serving app's class name: a metrics label, no policy reads it
        # vLLM's ``cache_salt``: mixed into the name of its first page, so only requests with the same
        # salt share cached pages with it (a tenant's isolation; None: shared with every unsalted one).
        self.cache_salt = cache_salt
        self.lora = None  # the LoRA adapter it runs with (``lora.manager.LoRARef``), None: the base model
        self.lora_name: str | None = None  # the adapter it names (its slot, ``lora``, is taken when it is added)
        max_new = max_total_tokens - len(self.prompt_token_ids)
        if sampling_params.max_tokens is not None:
            max_new = min(max_new, sampling_params.max_tokens)
        self.max_output_tokens = max_new
        self.max_num_tokens = len(self.prompt_token_ids) + max_new  # tokens it holds when it finishes

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None

        # Cache state: owned by the cache manager, read by scheduler and runner.
        self.kind: CacheKind | None = None
        self.last_kind: CacheKind | None = None  # kept after the pages are freed, for metrics
        self.page_ids: list[int] = []
        # Swapped out (preempted into the tier below memory): the slots holding its pages, in order.
        # It keeps ``kind`` and ``num_computed_tokens`` and holds no pages until it is swapped back in.
        self.swap_slots: list[int] = []
        # A shared prefix kept in another kind (a compression in place keeps the pages other requests
        # share, and turns only its own): its first ``num_prefix_pages`` pages hold tokens
        # [0, num_prefix_tokens) in ``prefix_kind``, the rest the later tokens in ``kind``. None: one kind.
        self.prefix_kind: CacheKind | None = None
        self.num_prefix_pages = 0
        self.num_prefix_tokens = 0
        # Prefix caching: the names of its full pages, per kind (``CacheManager.block_hashes``; keyed
        # (prefix kind, pages, kind) for the pages after a prefix segment, ``segment_hashes``); how many
        # of its pages are named (-1: none from now on, its pages changed kind in place); and the
        # prompt tokens found cached when it was first admitted (None before).
        self.block_hashes: dict[CacheKind | tuple, list[bytes]] = {}
        self.num_named_pages = 0
        self.num_cached_tokens: int | None = None
        # Output tokens already returned in a RequestOutput (and whether one was returned at all):
        # what a delta output starts from.
        self.num_emitted_tokens = 0
        self.output_emitted = False

        # Timestamps (time.monotonic seconds) for every latency metric.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_times: list[float] = []
        self.max_gap = 0.0  # longest gap between consecutive output tokens so far
        # The largest gaps and how long the next may be while the P99 can still pass (``gap_budget``).
        self.gap_budget = GapBudget(tbt_slo_ms / 1000.0, max(1, self.max_output_tokens - 1))
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.num_upgrades = 0
        self.num_compressions = 0  # in place, to an int8 kind (under memory pressure)
        self.num_swaps = 0  # preemptions that kept its pages in the tier below memory

    # Token counts -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_swapped(self) -> bool:
        """Its computed tokens wait in the tier below memory (``swap_slots``), not in pages."""
        return bool(self.swap_slots)

    @property
    def is_decoding(self) -> bool:
        """Has produced a token and has exactly one token left to compute (steady-state decode)."""
        return self.num_output_tokens > 0 and self.num_tokens_to_compute == 1

    # Latency bookkeeping ------------------------------------------------------------------------
    def pending_time(self, now: float) -> float:
        """Time since this request last received a token (or since arrival before its first)."""
        last = self.last_token_time if self.last_token_time is not None else self.arrival_time
        return max(0.0, now - last)

    def deadline(self) -> float:
        """When the next token is due under its SLO."""
        if self.last_token_time is None:
            return self.arrival_time + self.ttft_slo_ms / 1000.0
        return self.last_token_time + self.tbt_slo_ms / 1000.0

    @property
    def gap_allowance(self) -> float:
        """Seconds its next gap may last while the P99 of its gaps can still meet the TBT target (inf:
        any; < 0: it cannot any more). See ``gap_budget``."""
        return self.gap_budget.allowance

    def has_missed_slo(self, now: float) -> bool:
        """True once it can no longer pass: its first token came (or is) later than the TTFT target, or
        its gaps so far (the one running now included) leave no way for their P99 to meet the TBT target
        (``gap_budget``: one long gap among many short ones may still pass)."""
        if self.first_token_time is None:
            return now - self.arrival_time > self.ttft_slo_ms / 1000.0
        if self.first_token_time - self.arrival_time > self.ttft_slo_ms / 1000.0:
            return True
        allowance = self.gap_budget.allowance
        return allowance < 0 or (not self.is_finished and now - self.last_token_time > allowance)

    def append_output_token(self, token_id: int, now: float) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            gap = now - self.last_token_time
            self.max_gap = max(self.max_gap, gap)
            self.gap_budget.add(gap)
        self.last_token_time = now
        self.token_times.append(now)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value}, kind={self.kind.value if self.kind else None}, pages={len(self.page_ids)})"
        )

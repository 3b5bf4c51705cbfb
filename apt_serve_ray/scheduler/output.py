"""The whole contract between the scheduler and the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from apt_serve_ray.cache.cache_manager import ConversionPlan, SwapPlan
from apt_serve_ray.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this chunk the request has computed all known tokens, so the step samples one."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # In-place kind changes (upgrades to KV, compressions to int8), run before the forward pass.
    conversions: list[ConversionPlan] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    schedule_time_s: float = 0.0
    preempt_causes: list[str] = field(default_factory=list)  # parallel to ``preempted``
    # The tier below memory, run first (outs, then ins): pages of preempted requests to slots, and
    # slots of resumed ones to their new pages. ``preempt_swapped``: parallel to ``preempted``, True
    # where the request kept its computed tokens in slots, False where it will be recomputed.
    swap_out: list[SwapPlan] = field(default_factory=list)
    swap_in: list[SwapPlan] = field(default_factory=list)
    preempt_swapped: list[bool] = field(default_factory=list)
    # Seconds the policy priced for this step's in-place kind changes and transfers, beside what its
    # step-time model predicts for the chunks (the engine adds the two: ``StepStats.predicted_s``).
    planned_extra_s: float = 0.0
    # Waiting requests the policy turned away because they cannot start in time (``shed``): the engine
    # ends each with an explicit "overloaded" error. They hold no pages and no slots.
    shed: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run. A step that only swaps out still runs: the freed pages' bytes must reach
        the slots before any later step writes them."""
        return not self.chunks and not self.conversions and not self.swap_out and not self.swap_in

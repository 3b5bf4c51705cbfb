"""The whole contract between the scheduler and the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from apt_serve_ray.cache.cache_manager import UpgradePlan
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
    upgrades: list[UpgradePlan] = field(default_factory=list)  # run before the forward pass
    preempted: list[Request] = field(default_factory=list)
    schedule_time_s: float = 0.0
    preempt_causes: list[str] = field(default_factory=list)  # parallel to ``preempted``

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.upgrades

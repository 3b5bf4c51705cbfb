"""The policy interface and the two moves every policy composes: run the running, admit the waiting."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Iterable

from apt_serve_ray.request import Request, RequestStatus
from apt_serve_ray.scheduler.costs import StepCosts


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    # The step costs a policy prices its choices with; None: it prices nothing. Whoever runs the
    # model fills in the unknown ones and injects them (``set_costs``); the policy never measures.
    costs: StepCosts | None = None

    def __init__(self, config=None) -> None:
        self.config = config

    def set_costs(self, costs: StepCosts) -> None:
        self.costs = costs

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """After each step that ran with a prediction (``StepStats.predicted_s``: the step-time model's
        seconds for its chunks plus ``SchedulerOutput.planned_extra_s``): what it took.
        A policy that sizes steps by its model may correct the model with it; by default, nothing."""

    @abstractmethod
    def schedule(self, ctx) -> None:
        """Choose this step's work through ``ctx`` (a ``SchedulingContext``)."""


def run_running(ctx, order: Iterable[Request], victim_key: Callable[[Request], object], chunked: bool) -> None:
    """Give each running request in ``order`` its next tokens (a chunk of them when ``chunked``).
    When pages run out, preempt the running request with the largest ``victim_key`` (possibly the
    request itself, which then waits)."""
    for request in list(order):
        if request.status is not RequestStatus.RUNNING or ctx.is_scheduled(request):
            continue
        n = request.num_tokens_to_compute
        if chunked:
            n = min(n, ctx.token_budget)
        if n <= 0 or n > ctx.token_budget or ctx.num_seqs_left <= 0:
            continue
        while not ctx.schedule(request, n):
            if ctx.cache.can_allocate(request, request.num_computed_tokens + n):
                break  # not memory: budget or sequence limit
            victim = max(ctx.running, key=victim_key)
            ctx.preempt(victim)
            if victim is request:
                break


def admit_waiting(ctx, order: Iterable[Request], chunked: bool, kind_for=None) -> int:
    """Admit waiting requests in ``order`` until the first that does not fit (head-of-line, as vLLM
    does). Returns how many were scheduled."""
    admitted = 0
    for request in list(order):
        if request.status is not RequestStatus.WAITING or not ctx.can_admit(request):
            continue
        kind = kind_for(request) if kind_for else None
        n = ctx.tokens_to_compute(request, kind)  # less what the prefix cache holds
        if chunked:
            n = min(n, ctx.token_budget)
        if n <= 0 or n > ctx.token_budget:
            break
        if not ctx.schedule(request, n, kind):
            break
        admitted += 1
    return admitted

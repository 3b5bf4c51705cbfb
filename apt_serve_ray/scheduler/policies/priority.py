"""vLLM's priority scheduling: lower ``priority`` value first, then arrival; the lowest-priority
(then newest) running request is preempted when pages run out. Chunked prefill as in sarathi."""

from __future__ import annotations

from apt_serve_ray.scheduler.policies.base import SchedulingPolicy, admit_waiting, run_running
from apt_serve_ray.scheduler.registry import register_policy


def _rank(request):
    return (request.priority, request.arrival_time, request.seq)


@register_policy
class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def schedule(self, ctx) -> None:
        order = sorted(ctx.running, key=lambda r: (not r.is_decoding, _rank(r)))
        run_running(ctx, order, victim_key=_rank, chunked=True)
        if not ctx.preempted_this_step:
            admit_waiting(ctx, sorted(ctx.waiting, key=_rank), chunked=True)

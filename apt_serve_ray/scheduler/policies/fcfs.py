"""vLLM 0.5 style: whole prefills first (decodes stall for that step), no chunking, and when pages
run out the newest running request is preempted by recompute."""

from __future__ import annotations

from apt_serve_ray.scheduler.policies.base import SchedulingPolicy, admit_waiting, run_running
from apt_serve_ray.scheduler.registry import register_policy


@register_policy
class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def schedule(self, ctx) -> None:
        # Without chunking a prompt must fit one step, so the budget is at least the context length.
        ctx.token_budget = max(ctx.token_budget, ctx.max_model_len)
        if ctx.waiting and admit_waiting(ctx, ctx.waiting, chunked=False):
            return
        run_running(ctx, ctx.running, victim_key=lambda r: (r.arrival_time, r.seq), chunked=False)

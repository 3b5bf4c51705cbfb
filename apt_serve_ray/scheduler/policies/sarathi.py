"""vLLM v1 / Sarathi-Serve style: running decodes first, then chunked prefills under the token
budget, FCFS admission; the newest running request is preempted when pages run out."""

from __future__ import annotations

from apt_serve_ray.scheduler.policies.base import SchedulingPolicy, admit_waiting, run_running
from apt_serve_ray.scheduler.registry import register_policy


@register_policy
class SarathiPolicy(SchedulingPolicy):
    name = "sarathi"

    def schedule(self, ctx) -> None:
        decodes_first = sorted(ctx.running, key=lambda r: not r.is_decoding)  # stable: keeps FCFS order
        run_running(ctx, decodes_first, victim_key=lambda r: (r.arrival_time, r.seq), chunked=True)
        if not ctx.preempted_this_step:
            admit_waiting(ctx, ctx.waiting, chunked=True, kind_for=self.kind_for)

    def kind_for(self, request):
        """Cache kind for a newly admitted request; None tracks the hidden target."""
        return None

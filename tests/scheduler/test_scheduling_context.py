"""The queues a decision leaves behind: admitted requests leave the waiting queue, preempted ones go to
its front, once, whatever order the policy admitted in."""

from __future__ import annotations

from apt_serve_ray.bench.simulator import MHA_LAYOUT
from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.request import Request, RequestStatus
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy
from apt_serve_ray.scheduler.scheduler import Scheduler


class Scripted(SchedulingPolicy):
    """Runs ``script(ctx)`` as its decision."""

    name = "scripted"

    def __init__(self, script) -> None:
        super().__init__()
        self.script = script

    def schedule(self, ctx) -> None:
        self.script(ctx)


def _scheduler(script, num_requests: int) -> tuple[Scheduler, list[Request]]:
    sched = Scheduler(EngineConfig(calibrate_rho=False), CacheManager(PagePool(64), MHA_LAYOUT), Scripted(script),
                      True, 1000)
    requests = [Request(f"r{i}", [7] * 10, SamplingParams(max_tokens=4), arrival_time=float(i), max_total_tokens=1000,
                        ttft_slo_ms=1000.0, tbt_slo_ms=100.0) for i in range(num_requests)]
    for r in requests:
        sched.add_request(r)
    return sched, requests


def test_requests_admitted_from_the_middle_leave_the_queue_in_order():
    seen_mid_decision = []

    def admit_2_and_4(ctx):
        waiting = list(ctx.waiting)
        assert ctx.schedule(waiting[4], 10) and ctx.schedule(waiting[2], 10)
        seen_mid_decision.extend(r.request_id for r in ctx.waiting)

    sched, requests = _scheduler(admit_2_and_4, 6)
    out = sched.schedule(0.0)
    assert [c.request.request_id for c in out.chunks] == ["r4", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r3", "r5"]
    assert seen_mid_decision == ["r0", "r1", "r3", "r5"]  # a policy never sees an admitted request wait
    assert sched.running == [requests[4], requests[2]]


def test_a_request_admitted_then_preempted_in_one_decision_waits_at_the_front_once():
    def admit_then_preempt(ctx):
        waiting = list(ctx.waiting)
        assert ctx.schedule(waiting[1], 10) and ctx.schedule(waiting[3], 10)
        ctx.preempt(waiting[3])

    sched, requests = _scheduler(admit_then_preempt, 5)
    out = sched.schedule(0.0)
    assert [r.request_id for r in sched.waiting] == ["r3", "r0", "r2", "r4"]
    assert out.preempted == [requests[3]] and requests[3].status is RequestStatus.WAITING
    assert sched.running == [requests[1]]
    sched.cache.pool.check_integrity()

"""The router's admission under the controller (``deployments/admission_gate.py``), without Ray: the
rule the router and the fleet simulator share, and the waits and refusals a request meets."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from deployments import openai_protocol as oai
from deployments.admission import AdmissionQueue, Ticket
from deployments.admission_gate import AdmissionGate, steer


class FakeLink:
    """``ControllerLink``'s surface the gate reads: admission open or closed, the last state."""

    def __init__(self, admission_open: bool = True, states=()) -> None:
        self.admission_open, self.states, self.state, self.arrivals = admission_open, list(states), None, 0

    async def poll(self):
        state = self.states.pop(0) if self.states else None
        if state is not None:
            self.state = state
        return state

    def is_admission_open(self) -> bool:
        return self.admission_open

    def retry_after_s(self) -> float:
        return 2.0

    def count_arrival(self) -> None:
        self.arrivals += 1


def state(limit: float, *priorities, adapters=None):
    replicas = {f"r{i}": SimpleNamespace(max_running_priority=p) for i, p in enumerate(priorities)}
    return SimpleNamespace(admission_limit=limit, replicas=replicas, adapters=adapters or {})


def test_steer_scales_the_slots_and_holds_all_but_the_more_important():
    queue = AdmissionQueue(max_in_flight=8, max_queued=4)
    steer(queue, 8, 0.5, held=True, running_priorities=[None, 2, 0])
    assert queue.max_in_flight == 4 and queue.held and queue.pass_below == 2.0
    assert queue.is_held(Ticket(1, 1.0, priority=2)) and not queue.is_held(Ticket(1, 1.0, priority=1))
    steer(queue, 8, 0.01, held=False, running_priorities=[None])  # at least one slot; nothing running
    assert queue.max_in_flight == 1 and not queue.held and queue.pass_below == -math.inf
    steer(queue, 8, None, held=False, running_priorities=[])  # no state: the slots stay as they are
    assert queue.max_in_flight == 1


@pytest.mark.asyncio
async def test_poll_steers_by_each_state_and_keeps_the_last_when_a_poll_fails():
    queue = AdmissionQueue(max_in_flight=10, max_queued=4)
    link = FakeLink(admission_open=False, states=[state(0.5, 3, adapters={"a": "/p"}), None])
    seen = []
    gate = AdmissionGate(queue, link, 10, "hold", poll_interval_s=0.001, on_rejected=lambda: None)
    task = asyncio.create_task(gate.poll(lambda s: seen.append(s.adapters)))
    await asyncio.sleep(0.02)
    task.cancel()
    assert seen == [{"a": "/p"}]  # only states that came
    assert queue.max_in_flight == 5 and queue.held and queue.pass_below == 3.0  # the failed poll kept the last


@pytest.mark.asyncio
async def test_refuse_mode_answers_503_at_once_and_counts_the_arrival():
    rejected = []
    link = FakeLink(admission_open=False)
    gate = AdmissionGate(AdmissionQueue(2, 2), link, 2, "refuse", 0.1, on_rejected=lambda: rejected.append(1))
    with pytest.raises(oai.APIError) as err:
        gate.refuse_if_saturated()
    assert err.value.status == 503 and err.value.code == "admission_closed" and err.value.retry_after_s == 2.0
    assert rejected == [1] and link.arrivals == 1


@pytest.mark.asyncio
async def test_a_full_line_gets_429_before_the_body_is_read():
    queue = AdmissionQueue(max_in_flight=1, max_queued=1)
    gate = AdmissionGate(queue, FakeLink(), 1, "hold", 0.1, on_rejected=lambda: None)
    await gate.acquire(Ticket(1, 10.0))
    waiting = asyncio.create_task(gate.acquire(Ticket(1, 10.0)))
    await asyncio.sleep(0)
    with pytest.raises(oai.APIError) as err:
        gate.refuse_if_saturated()
    assert err.value.status == 429 and err.value.code == "queue_full"
    queue.release()
    await waiting  # the one waiting got the slot


@pytest.mark.asyncio
async def test_a_held_request_waits_until_its_ttft_target_then_gets_503():
    queue = AdmissionQueue(max_in_flight=4, max_queued=4)
    queue.hold(True)
    gate = AdmissionGate(queue, FakeLink(admission_open=False), 4, "hold", 0.1, on_rejected=lambda: None)
    started = time.monotonic()
    with pytest.raises(oai.APIError) as err:
        await gate.acquire(Ticket(1, 0.05))
    assert err.value.status == 503 and 0.04 <= time.monotonic() - started < 1.0
    assert queue.num_in_flight == 0 and queue.num_waiting == 0  # nothing left behind


@pytest.mark.asyncio
async def test_a_held_request_goes_through_when_the_hold_lifts():
    queue = AdmissionQueue(max_in_flight=4, max_queued=4)
    queue.hold(True)
    gate = AdmissionGate(queue, FakeLink(admission_open=False), 4, "hold", 0.1, on_rejected=lambda: None)
    waiting = asyncio.create_task(gate.acquire(Ticket(1, 5.0)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    queue.hold(False)
    await asyncio.wait_for(waiting, 1.0)
    assert queue.num_in_flight == 1

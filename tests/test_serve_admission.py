"""The router's admission queue: a bounded number in flight, the rest let through by score."""

from __future__ import annotations

import asyncio
import time

import pytest

from apt_serve_ray.scheduler.value import ValueWeights
from deployments.admission import ADMISSION_WEIGHTS, AdmissionQueue, QueueFull, Ticket


async def admitted_order(queue: AdmissionQueue, tickets: list[Ticket]) -> list[int]:
    """Fill the only slot, queue ``tickets``, then release slots one by one; return who got in, in order."""
    await queue.acquire(Ticket(1, 10.0))
    order: list[int] = []

    async def wait(i: int, ticket: Ticket) -> None:
        await queue.acquire(ticket)
        order.append(i)

    tasks = [asyncio.create_task(wait(i, t)) for i, t in enumerate(tickets)]
    await asyncio.sleep(0)
    for _ in tickets:
        queue.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


@pytest.mark.asyncio
async def test_under_capacity_requests_pass_at_once():
    queue = AdmissionQueue(max_in_flight=2, max_queued=0)
    async with queue.slot(Ticket(4, 1.0)):
        async with queue.slot(Ticket(4, 1.0)):
            assert queue.num_in_flight == 2
            with pytest.raises(QueueFull):
                await queue.acquire(Ticket(4, 1.0))
    assert queue.num_in_flight == 0


@pytest.mark.asyncio
async def test_waiting_requests_go_by_value_per_page_not_arrival():
    now = time.monotonic()
    tickets = [Ticket(num_pages=40, ttft_slo_s=60, arrival=now - 2.0),   # waited longest but large
               Ticket(num_pages=2, ttft_slo_s=60, arrival=now - 1.0),    # small: best value per page
               Ticket(num_pages=10, ttft_slo_s=60, arrival=now - 1.5)]
    queue = AdmissionQueue(max_in_flight=1, max_queued=10, weights=ValueWeights(slo_weight=0, priority_weight=0))
    assert await admitted_order(queue, tickets) == [1, 2, 0]


@pytest.mark.asyncio
async def test_priority_and_slo_urgency_move_requests_ahead():
    now = time.monotonic()
    weights = ValueWeights(time_weight=0, memory_weight=0, slo_weight=1, priority_weight=1)
    by_priority = [Ticket(4, 60, priority=5, arrival=now), Ticket(4, 60, priority=-1, arrival=now)]
    assert await admitted_order(AdmissionQueue(1, 10, weights), by_priority) == [1, 0]
    by_deadline = [Ticket(4, 60, arrival=now), Ticket(4, 0.5, arrival=now)]  # the second is due in 0.5 s
    assert await admitted_order(AdmissionQueue(1, 10, weights, slack_s=1.0), by_deadline) == [1, 0]


@pytest.mark.asyncio
async def test_a_request_waiting_past_max_wait_goes_first():
    now = time.monotonic()
    tickets = [Ticket(1000, 60, arrival=now - 31), Ticket(1, 60, arrival=now)]
    queue = AdmissionQueue(1, 10, ValueWeights(slo_weight=0, priority_weight=0), max_wait_s=30)
    assert await admitted_order(queue, tickets) == [0, 1]


@pytest.mark.asyncio
async def test_a_caller_that_leaves_the_line_gives_its_place_up():
    queue = AdmissionQueue(max_in_flight=1, max_queued=5)
    await queue.acquire(Ticket(1, 10.0))
    leaver = asyncio.create_task(queue.acquire(Ticket(1, 10.0)))
    stayer = asyncio.create_task(queue.acquire(Ticket(100, 10.0)))
    await asyncio.sleep(0)
    leaver.cancel()
    await asyncio.sleep(0)
    assert queue.num_waiting == 1
    queue.release()
    await asyncio.wait_for(stayer, 1)
    assert queue.num_in_flight == 1


def test_admission_weights_are_the_value_models_weights_with_all_terms_on_by_default():
    assert isinstance(ADMISSION_WEIGHTS, ValueWeights)
    assert ADMISSION_WEIGHTS == ValueWeights(time_weight=1, memory_weight=1, slo_weight=1, priority_weight=1)
    assert AdmissionQueue(1, 0).weights == ADMISSION_WEIGHTS


def test_the_app_argument_is_validated_by_the_one_weights_type():
    from pydantic import ValidationError

    from deployments.app import AppArgs

    assert AppArgs().admission_weights == ADMISSION_WEIGHTS
    # Fields left out keep the admission defaults, not the value model's (slo and priority off).
    partial = AppArgs(admission_weights={"time_weight": 2.0}).admission_weights
    assert partial == ValueWeights(time_weight=2.0, memory_weight=1.0, slo_weight=1.0, priority_weight=1.0)
    for bad, field in (({"slo_weight": -1}, "slo_weight"), ({"memory_weight": float("nan")}, "memory_weight"),
                       ({"urgency_weight": 1}, "urgency_weight")):
        with pytest.raises(ValidationError, match=field):
            AppArgs(admission_weights=bad)

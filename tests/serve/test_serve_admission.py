"""The router's admission queue: a bounded number in flight, the rest let through by score."""

from __future__ import annotations

import asyncio
import time

import pytest

from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler
from apt_serve_ray.scheduler.value import MAX_WAIT_S, ValueWeights
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
@pytest.mark.parametrize("policy_weights, expected", [({}, [1, 0]), ({"priority_weight": 0.0}, [0, 1])])
async def test_admission_orders_by_the_engine_policys_weights(policy_weights, expected):
    from deployments.app import AppArgs, admission_weights

    args = AppArgs(policy="apt", policy_weights=policy_weights)
    now = time.monotonic()
    # The second is 5 levels more important (10 s of waiting at the default priority_weight), 3 s newer.
    tickets = [Ticket(4, 60, priority=5, arrival=now - 3.0), Ticket(4, 60, priority=0, arrival=now)]
    queue = AdmissionQueue(1, 10, admission_weights(args, args.engine_config()))
    assert await admitted_order(queue, tickets) == expected


@pytest.mark.asyncio
async def test_admission_urgency_rises_over_the_whole_ttft_target_as_in_the_engine():
    now = time.monotonic()
    # The second has 1.1 s left of a 2 s target: urgency 0.45 over its target, 0 over a 1 s slack.
    tickets = [Ticket(4, 60, arrival=now - 1.0), Ticket(4, 2.0, arrival=now - 0.9)]
    assert await admitted_order(AdmissionQueue(1, 10), list(tickets)) == [1, 0]
    assert await admitted_order(AdmissionQueue(1, 10, slack_s=1.0), list(tickets)) == [0, 1]


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


@pytest.mark.asyncio
async def test_is_full_says_in_advance_that_the_next_request_gets_queue_full():
    from deployments.admission import QueueFull

    queue = AdmissionQueue(max_in_flight=1, max_queued=1)
    assert not queue.is_full
    await queue.acquire(Ticket(1, 10.0))
    assert not queue.is_full  # one more may wait
    waiter = asyncio.create_task(queue.acquire(Ticket(1, 10.0)))
    await asyncio.sleep(0)
    assert queue.is_full
    with pytest.raises(QueueFull):
        await queue.acquire(Ticket(1, 10.0))
    queue.release()
    await asyncio.wait_for(waiter, 1)
    assert not queue.is_full
    assert AdmissionQueue(max_in_flight=1, max_queued=0).is_full is False  # a free slot: admitted at once


def test_admission_defaults_are_the_engines_value_model():
    assert isinstance(ADMISSION_WEIGHTS, ValueWeights)
    assert ADMISSION_WEIGHTS == ValueWeights() == AdaptiveScheduler().weights
    queue = AdmissionQueue(1, 0)
    assert queue.weights == ADMISSION_WEIGHTS and queue.max_wait_s == AdaptiveScheduler().max_wait_time == MAX_WAIT_S


def test_the_app_argument_is_validated_by_the_one_weights_type():
    from pydantic import ValidationError

    from deployments.app import AppArgs, admission_weights

    # Not given: the engine policy's weights, from policy_weights over policy_options.
    args = AppArgs(policy_options={"slo_weight": 0.5, "priority_weight": 4.0}, policy_weights={"priority_weight": 3.0})
    assert admission_weights(args, args.engine_config()) == ValueWeights(slo_weight=0.5, priority_weight=3.0)
    assert admission_weights(AppArgs(), AppArgs().engine_config()) == ADMISSION_WEIGHTS
    # Given: an override; the fields left out keep the value model's defaults.
    partial = AppArgs(admission_weights={"time_weight": 2.0})
    assert admission_weights(partial, partial.engine_config()) == ValueWeights(time_weight=2.0)
    for bad, field in (({"slo_weight": -1}, "slo_weight"), ({"memory_weight": float("nan")}, "memory_weight"),
                       ({"urgency_weight": 1}, "urgency_weight")):
        with pytest.raises(ValidationError, match=field):
            AppArgs(admission_weights=bad)


@pytest.mark.asyncio
async def test_a_tightened_limit_holds_new_requests_and_a_relaxed_one_lets_them_through():
    queue = AdmissionQueue(max_in_flight=4, max_queued=10)
    for _ in range(2):
        await queue.acquire(Ticket(1, 10.0))
    queue.resize(2)  # the controller forecasts a peak over the heavy watermark
    waiting = asyncio.create_task(queue.acquire(Ticket(1, 10.0)))
    await asyncio.sleep(0)
    assert not waiting.done() and queue.num_waiting == 1
    queue.resize(4)  # relaxed: the waiting request goes in at once, no release needed
    await asyncio.wait_for(waiting, 1)
    assert queue.num_in_flight == 3
    with pytest.raises(ValueError, match="max_in_flight"):
        queue.resize(0)


@pytest.mark.asyncio
async def test_a_held_queue_grants_no_slot_and_lets_its_line_through_by_score_when_released():
    now = time.monotonic()
    queue = AdmissionQueue(max_in_flight=4, max_queued=2, weights=ValueWeights(slo_weight=0, priority_weight=0))
    await queue.acquire(Ticket(1, 10.0))  # in flight before the hold: it goes on
    queue.hold(True)
    order: list[int] = []

    async def wait(i: int, ticket: Ticket) -> None:
        await queue.acquire(ticket)
        order.append(i)

    tasks = [asyncio.create_task(wait(i, t)) for i, t in enumerate(
        [Ticket(40, 60, arrival=now - 2.0), Ticket(2, 60, arrival=now - 1.0)])]
    await asyncio.sleep(0.01)
    assert order == [] and queue.num_in_flight == 1 and queue.num_waiting == 2  # slots free, none granted
    assert queue.is_full  # the line (2) is full: a third request would get QueueFull
    with pytest.raises(QueueFull):
        await queue.acquire(Ticket(1, 60))
    queue.release()  # a request finishing during the hold does not let the line move
    await asyncio.sleep(0.01)
    assert order == [] and queue.num_in_flight == 0
    queue.hold(False)
    await asyncio.gather(*tasks)
    assert order == [1, 0] and queue.num_in_flight == 2  # best value per page first


@pytest.mark.asyncio
async def test_a_hold_lets_through_requests_more_important_than_any_running():
    # Over the heavy watermark a chat (priority 0) may displace a running document (priority 10) in the
    # engine; held in the router it could only wait out its TTFT target and get a 503 (issue 26: six
    # chats of a burst, bf16, 0.5 req/s).
    queue = AdmissionQueue(max_in_flight=8, max_queued=8)
    queue.hold(True, pass_below=10)
    batch = asyncio.create_task(queue.acquire(Ticket(4, 30.0, priority=10)))  # as unimportant: held
    await asyncio.sleep(0.01)
    assert not batch.done() and queue.is_held(Ticket(1, 1.0, priority=10))
    await asyncio.wait_for(queue.acquire(Ticket(2, 2.0, priority=0)), 0.05)  # not held, not behind it
    assert queue.num_in_flight == 1 and queue.num_waiting == 1
    queue.hold(True)  # nothing running to displace: everyone waits
    assert queue.is_held(Ticket(2, 2.0, priority=-5))
    queue.hold(False)
    await asyncio.wait_for(batch, 0.05)
    assert queue.num_in_flight == 2


@pytest.mark.asyncio
async def test_a_request_that_stops_waiting_during_a_hold_leaves_the_line():
    queue = AdmissionQueue(max_in_flight=1, max_queued=4)
    queue.hold(True)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.acquire(Ticket(1, 1.0)), 0.05)
    assert queue.num_waiting == 0 and queue.num_in_flight == 0
    queue.hold(False)
    await queue.acquire(Ticket(1, 1.0))
    assert queue.num_in_flight == 1


@pytest.mark.asyncio
async def test_a_request_that_can_no_longer_meet_its_ttft_goes_after_those_that_can():
    """Oldest-first would serve the one that has missed (waited 5 s of a 3-s target) while the others
    wait until they have missed too: under a backlog longer than the target, nobody would pass."""
    now = time.monotonic()
    weights = ValueWeights(slo_weight=0, priority_weight=0)
    tickets = [Ticket(4, 3.0, arrival=now - 5.0),   # missed
               Ticket(4, 3.0, arrival=now - 1.0),   # 2 s left
               Ticket(4, 3.0, arrival=now - 0.5)]   # 2.5 s left
    assert await admitted_order(AdmissionQueue(1, 10, weights), list(tickets)) == [1, 2, 0]
    # fairness_penalty 1: a missed request keeps its whole value, and the oldest goes first again.
    assert await admitted_order(AdmissionQueue(1, 10, weights, fairness_penalty=1.0), list(tickets)) == [0, 1, 2]


@pytest.mark.asyncio
async def test_a_deadline_nearer_than_the_measured_ttft_counts_as_missed():
    now = time.monotonic()
    weights = ValueWeights(slo_weight=0, priority_weight=0)
    tickets = [Ticket(4, 3.0, arrival=now - 2.0),   # 1 s left: missed if admission -> first token takes 1.5 s
               Ticket(4, 3.0, arrival=now - 0.5)]
    queue = AdmissionQueue(1, 10, weights)
    assert queue.expected_ttft_s == 0.0
    for _ in range(100):
        queue.observe_ttft(1.5)
    assert queue.expected_ttft_s == pytest.approx(1.5, abs=1e-3)
    assert await admitted_order(queue, list(tickets)) == [1, 0]
    fast = AdmissionQueue(1, 10, weights)
    fast.observe_ttft(0.1)
    assert await admitted_order(fast, list(tickets)) == [0, 1]


@pytest.mark.asyncio
async def test_requests_that_have_missed_still_get_in_when_nobody_else_waits():
    now = time.monotonic()
    tickets = [Ticket(4, 1.0, arrival=now - 9.0), Ticket(4, 1.0, arrival=now - 5.0)]
    order = await admitted_order(AdmissionQueue(1, 10, ValueWeights(slo_weight=0, priority_weight=0)), tickets)
    assert order == [0, 1]  # among the missed, oldest first; nobody is dropped


def test_admission_fairness_penalty_is_validated_and_is_the_engines():
    with pytest.raises(ValueError, match="fairness_penalty"):
        AdmissionQueue(1, 1, fairness_penalty=0.0)
    assert AdmissionQueue(1, 1).fairness_penalty == AdaptiveScheduler().fairness_penalty


@pytest.mark.asyncio
async def test_a_hold_lets_through_a_request_whose_prefix_a_replica_holds_with_room_for_the_rest():
    # Over the heavy watermark a conversation's next turn needs only its new pages where its history is
    # cached; held, it would wait out its TTFT target, get a 503 and come back to compute it all again
    # (issue 27: every miss of the multi-turn trace at 0.3 sessions/s was such a 503).
    from collections import namedtuple

    from deployments.prefix_affinity import PrefixIndex, fits_beside_cached_prefix

    ReplicaKey = namedtuple("ReplicaKey", "unique_id")  # as Serve's ReplicaID: hashable, with its unique_id
    from serve_helpers import load_report

    index = PrefixIndex(16)
    history = list(range(1000, 1000 + 640))  # 40 pages
    replica = ReplicaKey("a")
    index.record(replica, index.block_hashes(history))
    turn = history + list(range(5, 85))  # 80 new tokens: 45 pages with its output horizon
    reports = [load_report(replica_id="b", num_free_pages=100), load_report(replica_id="a", num_free_pages=6)]
    assert fits_beside_cached_prefix(index, reports, turn, num_pages=46)  # 6 new pages on "a"
    assert not fits_beside_cached_prefix(index, reports, turn, num_pages=47)
    assert not fits_beside_cached_prefix(index, [load_report(replica_id="a", num_free_pages=6, num_pending_pages=1)],
                                         turn, num_pages=46)  # pages promised to others count
    assert not fits_beside_cached_prefix(index, reports, list(range(5, 700)), num_pages=46)  # nothing cached
    queue = AdmissionQueue(max_in_flight=4, max_queued=4)
    queue.hold(True)
    await asyncio.wait_for(queue.acquire(Ticket(46, 2.0, passes_hold=True)), 1.0)
    assert queue.num_in_flight == 1 and queue.is_held(Ticket(46, 2.0))

"""FitAwareRequestRouter and LoRA adapters: a request goes to a replica holding its adapter, else to one with a
slot to spare, never to one whose every slot requests hold while another has room (fake replicas, no cluster)."""

from __future__ import annotations

import time

import pytest
from ray.serve.request_router import PendingRequest
from ray.serve._private.common import RequestMetadata
from serve_helpers import load_report
from test_serve_request_router import FakeReplica, choose, make_router as _make_router

from apt_serve_ray import SamplingParams
from deployments.prefix_affinity import PrefixIndex
from deployments.request_router import FREE_SLOT, HOLDS, IDLE_SLOT, MUST_WAIT
from deployments.wire import EngineRequest


def stats(free: int = 100, *, loras=(), busy=(), max_loras: int = 2, at: float | None = None) -> dict:
    return load_report(time=time.time() - 1 if at is None else at, num_free_pages=free, loras=tuple(loras),
                       busy_loras=tuple(busy), max_loras=max_loras).to_dict()


def make_router(*replicas):
    router = _make_router(*replicas)
    router.prefixes = PrefixIndex(16)  # not the process's: prompts routed by other tests hold no prefix here
    return router


def pending(rid: str, adapter: str | None, prompt: list[int] | None = None) -> PendingRequest:
    request = EngineRequest(prompt or [1000 + sum(map(ord, rid))] + [1] * 31, SamplingParams(max_tokens=16), rid,
                            lora_name=adapter, lora_path=None)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(
        request_id=rid, internal_request_id=rid, call_method="generate"))


@pytest.mark.asyncio
async def test_a_request_goes_to_the_replica_holding_its_adapter_while_loads_are_close():
    a = FakeReplica("a", stats(free=90, loras=("x",)))
    b = FakeReplica("b", stats(free=100, loras=("y",)))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending("1", "x")))[0] == "a"  # b is less loaded, a holds x
    assert (await choose(router, [a, b], pending("2", "y")))[0] == "b"
    assert (await choose(router, [a, b], pending("3", None)))[0] == "b"  # the base model: the least loaded
    # A holder much busier than the least loaded gives way (as prefix affinity does).
    a.routing_stats = stats(free=10, loras=("x",), at=time.time())
    assert (await choose(router, [a, b], pending("4", "x")))[0] == "b"


@pytest.mark.asyncio
async def test_without_a_holder_a_free_slot_comes_before_an_idle_one_and_a_busy_replica_last():
    full_busy = FakeReplica("busy", stats(free=120, loras=("p", "q"), busy=("p", "q")))
    full_idle = FakeReplica("idle", stats(free=110, loras=("p", "q"), busy=("p",)))
    room = FakeReplica("room", stats(free=100, loras=("p",)))
    router = make_router(full_busy, full_idle, room)
    states = {r.name: router.adapter_state(r, "z") for r in (full_busy, full_idle, room)}
    assert states == {"busy": MUST_WAIT, "idle": IDLE_SLOT, "room": FREE_SLOT}
    assert (await choose(router, [full_busy, full_idle, room], pending("1", "z")))[0] == "room"
    # Once "room" is routed z it holds it (the ledger, before its next snapshot says so) and has no slot left.
    assert router.adapter_state(room, "z") == HOLDS
    assert router.adapter_state(room, "w") == IDLE_SLOT
    # Where every slot elsewhere is busy, the least loaded replica that can load the adapter wins, however loaded.
    full_idle.routing_stats = stats(free=20, loras=("p", "q"), busy=("p",), at=time.time())
    room.routing_stats = stats(free=20, loras=("p", "z"), busy=("p", "z"), at=time.time())
    assert (await choose(router, [full_busy, full_idle, room], pending("2", "w")))[0] == "idle"


@pytest.mark.asyncio
async def test_requests_of_one_adapter_routed_together_go_to_one_replica():
    a, b = FakeReplica("a", stats(free=100)), FakeReplica("b", stats(free=100))
    router = make_router(a, b)
    firsts = [(await choose(router, [a, b], pending(f"r{i}", "x")))[0] for i in range(4)]
    assert len(set(firsts)) == 1


@pytest.mark.asyncio
async def test_adapter_affinity_off_leaves_adapters_out_of_the_choice():
    a = FakeReplica("a", stats(free=90, loras=("x",)))
    b = FakeReplica("b", stats(free=100, loras=("y", "z"), busy=("y", "z")))
    router = make_router(a, b)
    router.adapter_affinity = False
    assert (await choose(router, [a, b], pending("1", "x")))[0] == "b"


@pytest.mark.asyncio
async def test_one_prompt_under_two_adapters_is_two_prefixes():
    a, b = FakeReplica("a", stats(free=100, loras=("x", "y"), max_loras=4)), FakeReplica("b", stats(free=100))
    router = make_router(a, b)
    system = list(range(100, 420))
    router.adapter_affinity = False  # the prefix index alone
    router.prefixes.record(a.replica_id, router.prefixes.block_hashes(system, (None, "lora", "x")))
    assert (await choose(router, [a, b], pending("1", "x", system + [5])))[0] == "a"  # its pages are there
    assert (await choose(router, [a, b], pending("2", "y", system + [6])))[0] == "b"  # not under adapter y

"""FitAwareRequestRouter ranks replicas by where a request fits, on fake replicas (no cluster)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest
from serve_helpers import load_report

from apt_serve_ray import SamplingParams
from deployments.request_router import FitAwareRequestRouter, request_pages
from deployments.wire import EngineRequest

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="test")


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 100

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.name, DEPLOYMENT)


def stats(free: int, *, pages: int = 128, running: int = 0, waiting: int = 0, pending: int = 0,
          at: float | None = None, pressured: bool = False, received: tuple[str, ...] | None = None) -> dict:
    """What Serve holds as a replica's routing stats: its ``LoadReport`` as a dict."""
    return load_report(time=time.time() - 1 if at is None else at, num_pages=pages, num_free_pages=free,
                       num_pending_pages=pending, num_running=running, num_waiting=waiting, max_num_seqs=16,
                       tokens_per_kv_page=16, is_pressured=pressured, received=received).to_dict()


def engine_request(num_prompt_tokens: int, max_tokens: int | None = 16, rid: str = "r",
                   prompt: list[int] | None = None, session: str | None = None) -> EngineRequest:
    """A prompt of its own (its first token from its id: no prefix shared by accident) unless given."""
    if prompt is None:
        prompt = [1000 + sum(map(ord, rid)) * 31 + len(rid)] + [1] * (num_prompt_tokens - 1)
    return EngineRequest(prompt, SamplingParams(max_tokens=max_tokens), rid, session_id=session)


def pending(num_prompt_tokens: int, max_tokens: int = 16, method: str = "generate", rid: str = "r",
            prompt: list[int] | None = None, session: str | None = None) -> PendingRequest:
    request = engine_request(num_prompt_tokens, max_tokens, rid, prompt, session)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(
        request_id=rid, internal_request_id=rid, call_method=method))


def make_router(*replicas: FakeReplica) -> FitAwareRequestRouter:
    router = FitAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(output_horizon_tokens=64)
    for r in replicas:
        router.curr_replicas[r.replica_id] = r
    return router


async def choose(router, replicas, request) -> list[str]:
    ranks = await router.choose_replicas(replicas, request)
    return [r.name for rank in ranks for r in rank]


def test_request_pages_counts_prompt_and_capped_output():
    assert request_pages(engine_request(100, max_tokens=10), 16, 64) == 7
    assert request_pages(engine_request(100, max_tokens=1000), 16, 64) == 11
    assert request_pages(engine_request(100, max_tokens=None), 16, 64) == 11


@pytest.mark.asyncio
async def test_a_request_goes_where_it_fits():
    a, b = FakeReplica("a", stats(free=30)), FakeReplica("b", stats(free=60, running=5))
    router = make_router(a, b)
    assert await choose(router, [a, b], pending(600)) == ["b", "a"]  # 39 pages: only b has them


@pytest.mark.asyncio
async def test_among_fits_the_least_loaded_after_placement_wins():
    a, b = FakeReplica("a", stats(free=40)), FakeReplica("b", stats(free=120))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending(32)))[0] == "b"


@pytest.mark.asyncio
async def test_a_replica_the_controller_marked_pressured_is_steered_around_while_another_has_room():
    a, b = FakeReplica("a", stats(free=120, pressured=True)), FakeReplica("b", stats(free=40))
    router = make_router(a, b)
    assert await choose(router, [a, b], pending(32)) == ["b", "a"]  # a has more room, but is pressured
    # Where the request fits nowhere else, the pressured replica still comes before one it does not fit.
    assert await choose(router, [a, b], pending(1000, rid="big")) == ["a", "b"]


@pytest.mark.asyncio
async def test_pending_prompt_pages_count_as_used():
    a, b = FakeReplica("a", stats(free=128, pending=120)), FakeReplica("b", stats(free=100))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending(320)))[0] == "b"


@pytest.mark.asyncio
async def test_requests_routed_together_see_each_other():
    a, b = FakeReplica("a", stats(free=128)), FakeReplica("b", stats(free=128))
    router = make_router(a, b)
    firsts = [(await choose(router, [a, b], pending(32, rid=f"r{i}")))[0] for i in range(8)]
    assert firsts.count("a") == firsts.count("b") == 4


@pytest.mark.asyncio
async def test_the_ledger_forgets_what_a_newer_snapshot_covers():
    a, b = FakeReplica("a", stats(free=128)), FakeReplica("b", stats(free=100))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending(1000, rid="big")))[0] == "a"  # 67 pages
    assert (await choose(router, [a, b], pending(500, rid="next")))[0] == "b"  # a has 61 left in the ledger
    a.routing_stats = stats(free=128, at=time.time() + 1)  # the big one finished before this snapshot
    assert (await choose(router, [a, b], pending(500, rid="later")))[0] == "a"


@pytest.mark.asyncio
async def test_a_snapshot_covers_only_the_requests_it_lists_as_received():
    # A snapshot taken after the big one was routed, while it was still on its way (a busy host), does
    # not count it: the router must keep counting it until a snapshot lists it.
    a, b = FakeReplica("a", stats(free=128, received=())), FakeReplica("b", stats(free=100, received=()))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending(1000, rid="big")))[0] == "a"  # 67 pages
    a.routing_stats = stats(free=128, at=time.time() + 1, received=())
    assert (await choose(router, [a, b], pending(500, rid="next")))[0] == "b"
    a.routing_stats = stats(free=61, at=time.time() + 2, received=("big",))  # arrived and prefilled
    b.routing_stats = stats(free=40, at=time.time() + 2, received=("next",))
    assert (await choose(router, [a, b], pending(500, rid="then")))[0] == "a"  # big counted once, not twice
    a.routing_stats = stats(free=128, at=time.time() + 3, received=("big",))  # and finished
    assert (await choose(router, [a, b], pending(500, rid="later")))[0] == "a"


@pytest.mark.asyncio
async def test_a_request_serve_sends_elsewhere_moves_in_the_ledger():
    a, b = FakeReplica("a", stats(free=128)), FakeReplica("b", stats(free=128))
    router = make_router(a, b)
    request = pending(1000, rid="big")
    first = (await choose(router, [a, b], request))[0]
    other = b if first == "a" else a
    router.on_request_routed(request, other.replica_id, None)
    assert (await choose(router, [a, b], pending(1000, rid="next")))[0] == first


@pytest.mark.asyncio
async def test_other_calls_and_unknown_replicas_are_left_to_serve():
    a, b = FakeReplica("a"), FakeReplica("b", stats(free=128))
    router = make_router(a, b)
    ranks = await router.choose_replicas([a, b], pending(10, method="load"))
    assert ranks == [[a, b]]
    assert sorted(await choose(router, [a, b], pending(10))) == ["a", "b"]  # a has no snapshot yet: still a choice
    text = PendingRequest(args=[EngineRequest("not tokenised", SamplingParams())], kwargs={}, metadata=RequestMetadata(
        request_id="t", internal_request_id="t", call_method="generate"))
    assert await router.choose_replicas([a, b], text) == [[a, b]]  # its size is unknown


# Prefix affinity ----------------------------------------------------------------------------------
SYSTEM = list(range(100, 420))  # a 320-token system prompt: 20 pages


@pytest.mark.asyncio
async def test_a_shared_prefix_follows_the_replica_that_holds_it_while_loads_are_close():
    a, b = FakeReplica("a", stats(free=100)), FakeReplica("b", stats(free=110))
    router = make_router(a, b)
    assert (await choose(router, [a, b], pending(0, rid="first", prompt=SYSTEM + [7, 8])))[0] == "b"
    # b is now the more loaded in the ledger, but holds the system prompt: the next user goes there too.
    assert (await choose(router, [a, b], pending(0, rid="second", prompt=SYSTEM + [9] * 30)))[0] == "b"
    # A prompt of its own goes to the least loaded.
    assert (await choose(router, [a, b], pending(40, rid="other")))[0] == "a"


@pytest.mark.asyncio
async def test_affinity_gives_way_when_the_replica_holding_the_prefix_is_much_busier():
    a, b = FakeReplica("a", stats(free=120)), FakeReplica("b", stats(free=30))
    router = make_router(a, b)
    router.prefixes.record(b.replica_id, router.prefixes.block_hashes(SYSTEM))
    # b holds the prefix, but would be 0.8 used after placement against a's 0.1: a takes it.
    assert (await choose(router, [a, b], pending(0, rid="x", prompt=SYSTEM + [5] * 40)))[0] == "a"


@pytest.mark.asyncio
async def test_pages_a_replica_holds_cost_no_free_pages_there():
    a, b = FakeReplica("a", stats(free=8)), FakeReplica("b", stats(free=30))
    router = make_router(a, b)
    router.prefixes.record(a.replica_id, router.prefixes.block_hashes(SYSTEM))
    # 27 pages with the output: only b has them free, but a holds 20 of them: it fits there too.
    key_a = router.rank_key(a, engine_request(0, prompt=SYSTEM + [5] * 80), cached_pages=20)
    key_b = router.rank_key(b, engine_request(0, prompt=SYSTEM + [5] * 80))
    assert key_a[0] == key_b[0] == 0


@pytest.mark.asyncio
async def test_a_conversation_sticks_to_its_replica():
    a, b = FakeReplica("a", stats(free=100)), FakeReplica("b", stats(free=110))
    router = make_router(a, b)
    first = (await choose(router, [a, b], pending(30, rid="t1", session="alice")))[0]
    later = [(await choose(router, [a, b], pending(30, rid=f"t{i}", session="alice")))[0] for i in range(2, 5)]
    assert later == [first] * 3
    router.on_replica_actor_died(ReplicaID(first, DEPLOYMENT))  # its replica went away: the session moves
    other = "a" if first == "b" else "b"
    remaining = [r for r in (a, b) if r.name == other]
    assert (await choose(router, remaining, pending(30, rid="t9", session="alice")))[0] == other


def test_the_array_ranking_orders_as_the_per_replica_keys_do():
    """``_rank``'s arrays (every replica with a snapshot) and ``rank_key`` (the per-replica path) agree:
    the same (group, load) keys in the same order, loads rounded alike (half-way values included)."""
    import random as rnd

    rng = rnd.Random(7)
    replicas = [FakeReplica(f"r{i}", stats(free=rng.randint(0, 128), running=rng.randint(0, 15),
                                           pending=rng.randint(0, 8), pressured=rng.random() < 0.2))
                for i in range(40)]
    replicas.append(FakeReplica("half", stats(free=64, pages=128, running=0)))  # load 0.5 + need: exact thirds
    router = make_router(*replicas)
    for tokens in (16, 300, 900, 2500):
        request = engine_request(tokens, rid=f"q{tokens}")
        ranked, keys = router._rank(replicas, request, {})
        expected = sorted(router.rank_key(r, request)[:2] for r in replicas)
        assert keys == [tuple(map(float, k)) for k in expected]
        assert [router.rank_key(r, request)[:2] for r in ranked] == expected


@pytest.mark.asyncio
async def test_a_replica_scaled_down_leaves_nothing_behind_in_the_router():
    a, b = FakeReplica("a", stats(free=60)), FakeReplica("b", stats(free=60))
    router = make_router(a, b)
    router._record(pending(100, rid="x"), a.replica_id, engine_request(100, rid="x"))
    router.prefixes.record(a.replica_id, router.prefixes.block_hashes([5] * 64))
    router.update_replicas([b])
    assert a.replica_id not in router.routed and "x" not in router._where
    assert router.prefixes.num_blocks(a.replica_id) == 0 and "a" not in router._since

"""The tier below memory (``swap_space``): preempted requests' pages go to slots and come back instead
of being recomputed; byte-exact for every kind, same outputs, fewer recomputed tokens, nothing lost
when the tier is full, nothing leaked under aborts."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from apt_serve_ray import LLM, EngineConfig, SamplingParams
from apt_serve_ray.bench.simulator import MHA_LAYOUT, CostModel, SimulatedEngine
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.quant import quantize
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.cache.swap import GIB, SwapSpace
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.context import SchedulingContext

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TINY = CacheLayout(num_layers=2, num_kv_heads=4, head_dim=16, hidden_size=64, block_size=16, dtype_bytes=4)


def _gib(num_slots: int, layout: CacheLayout) -> float:
    return num_slots * layout.bytes_per_page / GIB


def _prompts(n, seed, lo=40, hi=90):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _fill(storage: CacheStorage, kind: CacheKind, pages: list[int], gen: torch.Generator) -> None:
    """Write random content of ``kind`` into ``pages`` through that kind's own views."""
    lay = storage.layout
    p = torch.tensor(pages)
    for layer in range(lay.num_layers):
        if kind is CacheKind.KV:
            view = storage.kv[layer]
            view[p] = torch.randn((len(pages), *view.shape[1:]), generator=gen).to(storage.dtype)
        elif kind is CacheKind.HIDDEN:
            view = storage.hidden[layer]
            view[p] = torch.randn((len(pages), *view.shape[1:]), generator=gen).to(storage.dtype)
        else:
            data = (storage.kv_int8 if kind is CacheKind.KV_INT8 else storage.hidden_int8)[layer]
            scale = (storage.kv_int8_scale if kind is CacheKind.KV_INT8 else storage.hidden_int8_scale)[layer]
            x = torch.randn((len(pages), *data.shape[1:]), generator=gen)
            group = lay.head_dim if kind is CacheKind.KV_INT8 else lay.quant_group
            q, s = quantize(x, group)
            data[p], scale[p] = q, s.view(len(pages), *scale.shape[1:])


@pytest.mark.parametrize("backing", ["anonymous", "file"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(CacheKind))
def test_pages_of_every_kind_round_trip_byte_exact(tmp_path, kind, dtype, backing):
    layout = CacheLayout(2, 4, 16, 64, 16, torch.finfo(dtype).bits // 8)
    storage = CacheStorage(layout, 12, "cpu", dtype)
    swap = SwapSpace(layout, 6, device="cpu", swap_dir=str(tmp_path) if backing == "file" else None)
    assert os.listdir(tmp_path) == []  # a file is unlinked once mapped: nothing is left behind
    assert ("memory-mapped file" if backing == "file" else "anonymous host memory") in swap.describe()
    gen = torch.Generator().manual_seed(0)
    _fill(storage, kind, [1, 4, 7], gen)
    before = [b[[1, 4, 7]].clone() for b in storage.bytes]
    slots = swap.allocate(3, "r")
    swap.copy_out(storage, [1, 4, 7], slots)
    _fill(storage, kind, [1, 4, 7], gen)  # the pages are reused meanwhile
    swap.copy_in(storage, slots, [9, 2, 11])  # and the request comes back to other pages
    for layer in range(layout.num_layers):
        assert torch.equal(storage.bytes[layer][[9, 2, 11]], before[layer])
    swap.free(slots, "r")
    swap.check_integrity()


def test_slots_have_owners_and_the_tier_says_no_when_full():
    swap = SwapSpace(TINY, 3)  # bookkeeping only
    a = swap.allocate(2, "a")
    assert swap.allocate(2, "b") is None and swap.num_free_slots == 1
    with pytest.raises(RuntimeError, match="owned by 'a'"):
        swap.free(a, "b")
    swap.free(a, "a")
    swap.check_integrity()
    assert swap.num_used_slots == 0
    with pytest.raises(RuntimeError, match="no backing"):
        swap.copy_out(CacheStorage(TINY, 2, "cpu", torch.float32), [0], [0])


def test_the_last_freed_slots_are_reused_first():
    # A stack, not a queue: the slots in use stay the few already written once. Cycling through the
    # whole file wrote cold blocks on every swap-out (2.4-3.7 ms a page instead of 0.2 ms, fp32 OPT-125m).
    swap = SwapSpace(TINY, 100)
    assert swap.allocate(3, "a") == [0, 1, 2]  # the low slots first
    b = swap.allocate(2, "b")
    swap.free(b, "b")
    assert sorted(swap.allocate(2, "c")) == sorted(b)
    swap.check_integrity()


def test_bandwidth_is_measured_and_leaves_the_pages_as_they_were():
    storage = CacheStorage(TINY, 10, "cpu", torch.float32)
    _fill(storage, CacheKind.KV, list(range(10)), torch.Generator().manual_seed(1))
    before = [b.clone() for b in storage.bytes]
    swap = SwapSpace(TINY, 16, device="cpu")
    cost = swap.measure_bandwidth(storage)
    assert swap.transfer is cost and 0 < cost.out_s_per_page < 1 and 0 < cost.in_s_per_page < 1
    assert all(torch.equal(a, b) for a, b in zip(before, storage.bytes))
    assert swap.num_used_slots == 0


def test_swap_space_validation_names_the_field(opt_tiny):
    for bad in (-1, True, "2", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="swap_space"):
            EngineConfig(swap_space=bad)
    with pytest.raises(ValueError, match="swap_dir"):
        EngineConfig(swap_dir="")
    with pytest.raises(ValueError, match="swap_space"):  # less than one page
        SimulatedEngine(EngineConfig(swap_space=1e-9))
    with pytest.raises(ValueError, match="swap_dir"):
        LLM(opt_tiny, dtype="float32", num_pages=16, swap_space=0.001, swap_dir="/nonexistent/apt-swap")


def _run_engine(path, prompts, **kw):
    """Step an engine on ``prompts`` with every integrity check; outputs, tokens computed, stats."""
    llm = LLM(path, dtype="float32", num_pages=24, max_num_batched_tokens=256, calibrate_rho=False, **kw)
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY).request_id for p in prompts]
    results, computed, swaps = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if engine.last_step is not None:
            computed += engine.last_step.num_tokens
            swaps += engine.last_step.num_swap_outs
        engine.check_integrity()
    stats = llm.cache_stats()
    assert stats.num_swap_outs == swaps and stats.num_used_swap_slots == 0
    assert stats.num_free_pages == stats.num_pages
    return [results[i] for i in ids], computed, stats


@pytest.mark.parametrize("policy,cache_ratio", [("sarathi", 0.0), ("sarathi", 0.5), ("apt", 0.0)])
def test_greedy_outputs_same_with_swap_and_fewer_tokens_recomputed(opt_tiny, policy, cache_ratio):
    # 8 requests of up to 130 tokens need ~60 pages; 24 force preemptions. With cache_ratio 0.5 part of
    # the swapped pages are hidden ones.
    prompts = _prompts(8, seed=2)
    ref, ref_computed, ref_stats = _run_engine(opt_tiny, prompts, policy=policy, cache_ratio=cache_ratio,
                                               swap_space=0)
    out, computed, stats = _run_engine(opt_tiny, prompts, policy=policy, cache_ratio=cache_ratio, swap_space=0.01)
    assert ref_stats.num_preemptions > 0 and ref_stats.num_swap_outs == 0
    assert stats.num_swap_slots == int(0.01 * GIB // stats.bytes_per_page) and stats.num_swap_outs > 0
    assert out == ref
    assert computed < ref_computed


def test_full_tier_falls_back_to_recompute_with_same_outputs(opt_tiny):
    prompts = _prompts(8, seed=2)
    ref, _, _ = _run_engine(opt_tiny, prompts)
    bytes_per_page = LLM(opt_tiny, dtype="float32", num_pages=4).cache_stats().bytes_per_page
    out, _, stats = _run_engine(opt_tiny, prompts, swap_space=6 * bytes_per_page / GIB)  # 6 slots
    assert stats.num_swap_slots == 6
    assert 0 < stats.num_swap_outs < stats.num_preemptions  # some swapped, the rest recomputed
    assert out == ref


def _sim(policy="sarathi", num_slots=200, num_pages=30, cost=CostModel(), **cfg) -> SimulatedEngine:
    config = EngineConfig(policy=policy, swap_space=_gib(num_slots, MHA_LAYOUT), max_num_batched_tokens=256,
                          calibrate_rho=False, **cfg)
    return SimulatedEngine(config, num_pages=num_pages, cost=cost)


def _swapped_waiting(sim: SimulatedEngine):
    for _ in range(12):
        sim.add(60, 40)
    while not any(r.is_swapped for r in sim.scheduler.waiting):
        sim.step()
    return next(r for r in sim.scheduler.waiting if r.is_swapped)


def test_abort_of_a_swapped_request_frees_its_slots():
    sim = _sim()
    swapped = _swapped_waiting(sim)
    swap, slots = sim.llm_engine.swap, list(swapped.swap_slots)
    used = swap.num_used_slots
    sim.llm_engine.abort_request(swapped.request_id)
    assert swapped.swap_slots == [] and swap.num_used_slots == used - len(slots)
    assert all(swap.owner(s) is None for s in slots)
    sim.llm_engine.check_integrity()
    sim.run_until_idle()
    engine = sim.llm_engine  # what is left in the tier are demoted prefix pages, no request's
    assert engine.swap.num_used_slots == engine.cache.num_tier_pages


@pytest.mark.parametrize("policy", ["fcfs", "sarathi", "priority", "apt"])
def test_integrity_of_both_tiers_under_preemption_and_aborts(policy):
    sim = _sim(policy, num_slots=12, num_pages=24)
    engine, rng, ids = sim.llm_engine, random.Random(7), []
    for step in range(400):
        if step < 150 and rng.random() < 0.4:
            ids.append(sim.add(rng.randrange(10, 120), rng.randrange(1, 200), priority=rng.randrange(3)).request_id)
        if ids and rng.random() < 0.1:
            engine.abort_request(ids[rng.randrange(len(ids))])
        sim.step()
        engine.check_integrity()
    sim.run_until_idle()
    engine.check_integrity()
    stats = engine.cache_stats()
    assert stats.num_swap_outs > 0 and stats.num_used_swap_slots == 0 and stats.num_free_pages == stats.num_pages
    assert sim.runner.num_pages_swapped_in <= sim.runner.num_pages_swapped_out


def test_swaps_only_where_the_transfer_is_cheaper_than_recompute():
    def run(cost: CostModel) -> tuple[int, int]:
        sim = _sim(cost=cost)
        sim.scheduler.policy.set_costs(StepCosts(step_time=cost))  # the recompute price
        for _ in range(12):
            sim.add(60, 40)
        sim.run_until_idle()
        stats = sim.llm_engine.cache_stats()
        return stats.num_preemptions, stats.num_swap_outs

    cheap_transfer = CostModel(per_token_s=0.001, swap_out_s_per_page=1e-4, swap_in_s_per_page=1e-4)
    preemptions, swaps = run(cheap_transfer)
    assert preemptions > 0 and swaps == preemptions
    slow_transfer = CostModel(per_token_s=1e-6, swap_out_s_per_page=0.01, swap_in_s_per_page=0.01)
    preemptions, swaps = run(slow_transfer)
    assert preemptions > 0 and swaps == 0


def test_swapped_request_resumes_where_it_stopped():
    sim = _sim()
    r = _swapped_waiting(sim)
    computed, kind, num_slots = r.num_computed_tokens, r.kind, len(r.swap_slots)
    assert computed > 0 and not r.page_ids
    while r.is_swapped:
        out = sim.step()
    plan = next(p for p in out.swap_in if p.request_id == r.request_id)
    assert len(plan.slots) == num_slots and r.kind is kind and r.page_ids[:num_slots] == plan.pages
    chunk = next(c for c in out.chunks if c.request is r)
    assert r.num_computed_tokens == computed + chunk.num_tokens  # it went on from there, no recompute


def test_preempted_in_the_step_that_swapped_it_in_goes_back_to_its_slots_without_copies():
    sim = _sim()
    r = _swapped_waiting(sim)
    for other in list(sim.scheduler.running):  # make room for it
        sim.scheduler.finish(other, other.status.FINISHED_ABORTED)
    slots, computed = list(r.swap_slots), r.num_computed_tokens
    ctx = SchedulingContext(sim.scheduler, sim.now)
    assert ctx.schedule(r, r.num_tokens_to_compute) and r.page_ids and not r.is_swapped
    ctx.preempt(r)
    out = ctx.output()
    assert out.swap_in == [] and out.swap_out == [] and out.preempt_swapped == [True]
    assert r.swap_slots == slots and r.num_computed_tokens == computed and not r.page_ids
    sim.cache.release_deferred()
    sim.llm_engine.check_integrity()


def test_preempted_after_an_upgrade_in_the_same_step_is_recomputed_and_the_upgrade_dropped():
    sim = _sim(cache_ratio=1.0)  # sarathi gives hidden pages
    r = sim.add(60, 10)
    sim.step()
    assert r.kind is CacheKind.HIDDEN and r.num_computed_tokens == 60
    ctx = SchedulingContext(sim.scheduler, sim.now)
    assert ctx.upgrade(r)
    ctx.preempt(r)  # its new KV pages would be filled only when the step runs: nothing to swap
    out = ctx.output()
    assert out.conversions == [] and out.swap_out == [] and out.preempt_swapped == [False]
    assert r.num_computed_tokens == 0 and not r.is_swapped
    sim.cache.release_deferred()
    sim.llm_engine.check_integrity()


def test_a_swapped_request_asked_for_another_kind_is_recomputed_in_it():
    sim = _sim()
    r = _swapped_waiting(sim)
    for other in list(sim.scheduler.running):
        sim.scheduler.finish(other, other.status.FINISHED_ABORTED)
    assert r.kind is CacheKind.KV
    ctx = SchedulingContext(sim.scheduler, sim.now)
    n = r.num_tokens_to_compute
    assert ctx.schedule(r, n, CacheKind.HIDDEN)
    assert r.kind is CacheKind.HIDDEN and not r.is_swapped and ctx.output().swap_in == []
    # Recomputed in it, from the start or after what the prefix cache holds of it in KV pages (its own
    # pages, left cached when it was swapped out): those it reads as a prefix segment.
    assert r.num_computed_tokens in (0, r.num_prefix_tokens) and r.prefix_kind in (None, CacheKind.KV)
    assert ctx.output().chunks[0].num_tokens == min(n, r.num_tokens - r.num_computed_tokens)
    assert sim.llm_engine.swap.num_used_slots == sim.cache.num_tier_pages  # its slots are free: the rest are demoted pages


def test_a_swapped_request_asked_for_its_int8_kind_comes_back_quantised_without_recompute():
    sim = _sim(cache_kinds=["hidden", "kv-int8"], cache_ratio=0.0)  # KV pages until the ceiling is raised
    r = _swapped_waiting(sim)
    for other in list(sim.scheduler.running):
        sim.scheduler.finish(other, other.status.FINISHED_ABORTED)
    sim.llm_engine.adjust_cache_ratio(1.0)
    computed, slots = r.num_computed_tokens, list(r.swap_slots)
    assert r.kind is CacheKind.KV and computed > 0
    ctx = SchedulingContext(sim.scheduler, sim.now)
    assert ctx.schedule(r, r.num_tokens_to_compute, CacheKind.KV_INT8)
    (plan,) = ctx.output().swap_in
    assert plan.is_conversion and plan.kind is CacheKind.KV and plan.to_kind is CacheKind.KV_INT8
    assert plan.slots == slots and plan.num_tokens == computed
    assert len(plan.pages) == MHA_LAYOUT.num_pages_for(computed, CacheKind.KV_INT8) < len(slots)
    assert r.kind is CacheKind.KV_INT8 and r.num_computed_tokens == computed and not r.is_swapped
    ctx.preempt(r)  # preempted in the same step: back to its slots, in its old kind
    assert r.kind is CacheKind.KV and r.swap_slots == slots and ctx.output().swap_in == []
    sim.cache.release_deferred()
    sim.llm_engine.check_integrity()
    with pytest.raises(ValueError, match="cannot come back as hidden"):
        sim.cache.swap_in(r, computed + 1, CacheKind.HIDDEN)  # x is gone: only a recompute gives hidden


@pytest.mark.parametrize("priced", [False, True], ids=["no-step-model", "step-model"])
def test_apt_brings_a_compressed_copy_back_in_its_kind_after_the_ceiling_fell(priced):
    # Admitted as kv-int8 under the ceiling (sarathi gives new requests the offered kind), swapped out,
    # and the ceiling lowered to 0 meanwhile: under apt it comes back in its own kind (a running
    # compressed request also keeps its pages past the ceiling), not recomputed in KV nor left waiting.
    from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

    sim = _sim("sarathi", cache_kinds=["kv-int8"], cache_ratio=1.0)
    r = _swapped_waiting(sim)
    assert r.kind is CacheKind.KV_INT8
    for other in list(sim.scheduler.running) + [w for w in sim.scheduler.waiting if w is not r]:
        sim.llm_engine.abort_request(other.request_id)
    sim.llm_engine.set_policy(AdaptiveScheduler(step_model=CostModel() if priced else None))
    sim.llm_engine.adjust_cache_ratio(0.0)
    computed = r.num_computed_tokens
    out = sim.step()
    assert not r.is_swapped and r.kind is CacheKind.KV_INT8
    (plan,) = out.swap_in
    assert not plan.is_conversion and plan.kind is CacheKind.KV_INT8
    chunk = next(c for c in out.chunks if c.request is r)
    assert r.num_computed_tokens == computed + chunk.num_tokens
    sim.llm_engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("from_kind,to_kind", [(CacheKind.KV, CacheKind.KV_INT8),
                                               (CacheKind.HIDDEN, CacheKind.HIDDEN_INT8)])
def test_a_copy_converted_on_its_way_in_is_quantised_exactly_like_a_write(opt_tiny, dtype, from_kind, to_kind):
    from apt_serve_ray.cache.cache_manager import SwapPlan

    llm = LLM(opt_tiny, dtype=dtype, num_pages=16, calibrate_rho=False, swap_space=0.001,
              cache_kinds=["hidden", "kv-int8", "hidden-int8"])
    runner = llm.llm_engine.runner
    storage, layout, swap = runner.storage, runner.layout, runner.swap
    gen = torch.Generator().manual_seed(0)
    _fill(storage, from_kind, [3, 8], gen)
    num_tokens = 2 * layout.tokens_per_page(from_kind) - 5  # the last page part-filled
    view = storage.kv if from_kind is CacheKind.KV else storage.hidden
    expected = [view[layer][[3, 8]].flatten(0, 1)[:num_tokens].clone() for layer in range(layout.num_layers)]
    slots = swap.allocate(2, "r")
    swap.copy_out(storage, [3, 8], slots)
    _fill(storage, from_kind, [3, 8], gen)  # the pages are reused meanwhile
    pages = [11] if layout.tokens_per_page(to_kind) >= num_tokens else [11, 5]
    runner._convert_in(SwapPlan("r", pages, slots, from_kind, to_kind, num_tokens))
    tpp = layout.tokens_per_page(to_kind)
    pos = torch.arange(num_tokens)
    dst_pages, dst_offs = torch.tensor(pages)[pos // tpp], pos % tpp
    ref = CacheStorage(layout, 16, "cpu", storage.dtype)  # the reference: the same tokens written as a step writes
    for layer in range(layout.num_layers):
        ref.write_int8(layer, to_kind, dst_pages, dst_offs, expected[layer])
        got_data, got_scale, ref_data, ref_scale = (
            (storage.kv_int8, storage.kv_int8_scale, ref.kv_int8, ref.kv_int8_scale) if to_kind is CacheKind.KV_INT8
            else (storage.hidden_int8, storage.hidden_int8_scale, ref.hidden_int8, ref.hidden_int8_scale))
        assert torch.equal(got_data[layer][dst_pages, dst_offs], ref_data[layer][dst_pages, dst_offs])
        assert torch.equal(got_scale[layer][dst_pages, dst_offs], ref_scale[layer][dst_pages, dst_offs])
    swap.free(slots, "r")


def test_apt_brings_swapped_requests_back_as_int8_when_their_kv_pages_do_not_fit(opt_tiny):
    # 4 requests that each grow to 600 tokens in a pool of 768 KV tokens: apt swaps them out in turn.
    # With kv-int8 allowed, a swapped one comes back quantised while its KV pages do not fit (it used
    # to wait, asked for KV, with pages free), and nothing is recomputed.
    llm = LLM(opt_tiny, dtype="float32", num_pages=48, policy="apt", calibrate_rho=False, swap_space=0.05,
              cache_kinds=["hidden", "kv-int8"], cache_ratio=1.0)
    engine = llm.llm_engine
    execute, plans = engine.runner.execute, []
    engine.runner.execute = lambda out: plans.extend(out.swap_in) or execute(out)
    for i in range(4):
        engine.add_request([13 + i] * 100, SamplingParams(max_tokens=500, ignore_eos=True))
    computed = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_step.num_tokens if engine.last_step is not None else 0
        engine.check_integrity()
    stats = llm.cache_stats()
    conversions = [p for p in plans if p.is_conversion]
    assert stats.num_swap_outs > 0 and conversions
    assert all(p.kind is CacheKind.KV and p.to_kind is CacheKind.KV_INT8 for p in conversions)
    assert computed == 4 * (100 + 500 - 1)  # every token computed once: no recompute
    assert stats.num_free_pages == stats.num_pages and stats.num_used_swap_slots == 0


def test_the_tier_holds_no_more_than_its_filesystem_has_free(monkeypatch, tmp_path, caplog):
    # A sparse file written past a full filesystem kills the process (SIGBUS on the mapping).
    from collections import namedtuple
    from types import SimpleNamespace

    from apt_serve_ray.cache import swap as swap_module
    from apt_serve_ray.cache.storage import CacheStorage

    storage = CacheStorage(MHA_LAYOUT, 4, "cpu", {2: torch.bfloat16, 4: torch.float32}[MHA_LAYOUT.dtype_bytes])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(swap_module.shutil, "disk_usage", lambda _: usage(0, 0, 10 * MHA_LAYOUT.bytes_per_page))
    tier = swap_module.make_swap_space(1.0, str(tmp_path), MHA_LAYOUT, SimpleNamespace(storage=storage))
    assert tier.num_slots == 9 and "the tier holds 9 pages" in caplog.text
    monkeypatch.setattr(swap_module.shutil, "disk_usage", lambda _: usage(0, 0, 0))
    assert swap_module.make_swap_space(1.0, str(tmp_path), MHA_LAYOUT, SimpleNamespace(storage=storage)) is None


def test_a_tier_in_memory_takes_at_most_half_the_memory_available(monkeypatch, caplog):
    from types import SimpleNamespace

    from apt_serve_ray.cache import swap as swap_module
    from apt_serve_ray.cache.storage import CacheStorage

    storage = CacheStorage(MHA_LAYOUT, 4, "cpu", {2: torch.bfloat16, 4: torch.float32}[MHA_LAYOUT.dtype_bytes])
    monkeypatch.setattr(swap_module, "_available_memory", lambda: 20 * MHA_LAYOUT.bytes_per_page)
    tier = swap_module.make_swap_space(1.0, None, MHA_LAYOUT, SimpleNamespace(storage=storage))
    assert tier.num_slots == 10 and "the tier holds 10 pages" in caplog.text
    assert "anonymous host memory" in tier.describe()


def test_memory_timeline_shows_pages_in_the_swap_tier(opt_tiny, tmp_path):
    from apt_serve_ray import CacheTracker

    llm = LLM(opt_tiny, dtype="float32", num_pages=24, max_num_batched_tokens=256, calibrate_rho=False,
              swap_space=0.01)
    tracker = CacheTracker(llm)
    engine = llm.llm_engine
    for p in _prompts(8, seed=2):
        engine.add_request(p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    series = tracker.series()
    assert max(series["swapped"]) > 0 and series["swapped"][-1] == 0  # pages went down a tier and came back
    assert set(series["swap_slots"]) == {llm.cache_stats().num_swap_slots}
    png = tracker.plot_memory_timeline(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0 and png.endswith(".png")


def _small_warm_steps(monkeypatch, layout):
    import apt_serve_ray.cache.swap as swap_mod

    monkeypatch.setattr(swap_mod, "WARM_START_BYTES", 4 * layout.bytes_per_page)
    monkeypatch.setattr(swap_mod, "WARM_AHEAD_BYTES", 8 * layout.bytes_per_page)
    monkeypatch.setattr(swap_mod, "_WARM_CHUNK_BYTES", layout.bytes_per_page)


def test_anonymous_tier_is_faulted_in_ahead_of_use_without_touching_what_slots_hold(monkeypatch):
    # A first write to anonymous memory took 4.65 ms a 590 KB slot here (a VM's host backs memory
    # lazily) against 0.025 ms again: the tier faults slots in ahead of use, in the background.
    _small_warm_steps(monkeypatch, TINY)
    swap = SwapSpace(TINY, 64, device="cpu")
    if swap.warm_slots == swap.num_slots:
        pytest.skip("MADV_POPULATE_WRITE is not available here: slots fault in as they are written")
    # 4 faulted in at once, then the warmer runs up to 8 ahead of the highest slot used (none yet)
    assert 4 <= swap.warm_slots <= 8 and swap.next_slot_is_warm()
    assert swap.num_warm_free_slots >= 4
    slots = swap.allocate(6, "a")  # past the warm ones: the warmer is asked to go 8 past slot 5
    data = swap._backing()
    data[slots[5]].fill_(7)  # a cold slot written before the warmer gets there
    deadline = time.monotonic() + 60
    while swap.warm_slots < 14 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 14 <= swap.warm_slots <= 16  # high water 6 + 8 ahead, rounded to whole chunks
    assert bool((data[slots[5]] == 7).all())  # populating leaves what a slot holds as it is
    swap.close()
    assert swap._warm_thread is None


def test_demotions_take_only_warm_slots_and_swap_outs_drop_demoted_pages_first(monkeypatch):
    _small_warm_steps(monkeypatch, TINY)
    swap = SwapSpace(TINY, 64, device="cpu")
    if swap.warm_slots == swap.num_slots:
        pytest.skip("MADV_POPULATE_WRITE is not available here")
    swap._warm_stop = True  # hold the warm frontier where it is
    swap._warm_wanted.set()
    swap._warm_thread.join(timeout=10)
    warm = swap.warm_slots
    taken = swap.allocate(warm, "a")
    assert not swap.next_slot_is_warm() and swap.num_warm_free_slots == 0
    swap.free(taken[-2:], "a")  # freed slots were written: warm, and reused first
    assert swap.next_slot_is_warm() and swap.num_warm_free_slots == 2

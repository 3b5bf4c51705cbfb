"""Running requests compressed in place (kv -> kv-int8, hidden -> hidden-int8): the quantised pages
equal what a write of the same tokens stores, the request keeps its first pages and gives the rest
back, generation goes on, and ``apt`` compresses running requests to admit a waiting one instead of
leaving it outside a full pool."""

from __future__ import annotations

import random

import pytest
import torch

from apt_serve_ray import LLM, EngineConfig, SamplingParams
from apt_serve_ray.bench.simulator import MHA_LAYOUT, CostModel, SimulatedEngine
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.output import ScheduledChunk
from apt_serve_ray.scheduler.policies.sarathi import SarathiPolicy
from apt_serve_ray.scheduler.context import SchedulingContext

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(10, 49000) for _ in range(n)]


@pytest.mark.parametrize("convert_chunk", [512, 16])  # 16: converted in pieces
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("from_kind,to_kind", [(CacheKind.KV, CacheKind.KV_INT8),
                                               (CacheKind.HIDDEN, CacheKind.HIDDEN_INT8)])
def test_compression_quantises_every_layer_like_a_write_and_gives_back_the_tail(opt_tiny, dtype, from_kind, to_kind,
                                                                                convert_chunk, monkeypatch):
    from apt_serve_ray.worker import model_runner

    monkeypatch.setattr(model_runner, "CONVERT_CHUNK", convert_chunk)
    llm = LLM(opt_tiny, dtype=dtype, num_pages=40, calibrate_rho=False, swap_space=0, policy="sarathi",
              cache_kinds=["hidden", "kv-int8", "hidden-int8"], cache_ratio=1.0)
    engine = llm.llm_engine
    storage, layout = engine.runner.storage, engine.layout
    request = engine.make_request(_prompt(150), SamplingParams(max_tokens=1))
    assert engine.cache.allocate(request, request.num_tokens, from_kind)
    engine.runner.logits_for_all_rows([ScheduledChunk(request, request.num_tokens)])
    request.num_computed_tokens = request.num_tokens
    n, old_pages = request.num_tokens, list(request.page_ids)
    pos = torch.arange(n)
    tpp = layout.tokens_per_page(from_kind)
    view = storage.kv if from_kind is CacheKind.KV else storage.hidden
    tokens = [view[layer][torch.tensor(old_pages)[pos // tpp], pos % tpp].clone() for layer in range(layout.num_layers)]

    plan = engine.cache.compress(request, to_kind)
    num = layout.num_pages_for(n, to_kind)
    assert plan.dst_pages == old_pages[:num] and request.page_ids == old_pages[:num] and num < len(old_pages)
    assert request.kind is to_kind and request.num_compressions == 1 and not plan.is_upgrade
    engine.runner._convert(plan)
    ref = CacheStorage(layout, 40, "cpu", storage.dtype)  # the same tokens written as a step writes them
    dst_tpp = layout.tokens_per_page(to_kind)
    dst = torch.tensor(plan.dst_pages)[pos // dst_tpp], pos % dst_tpp
    int8 = lambda s: (s.kv_int8, s.kv_int8_scale) if to_kind is CacheKind.KV_INT8 else (s.hidden_int8, s.hidden_int8_scale)  # noqa: E731
    for layer in range(layout.num_layers):
        ref.write_int8(layer, to_kind, *dst, tokens[layer])
        for got, want in zip(int8(storage), int8(ref)):
            assert torch.equal(got[layer][dst], want[layer][dst])
    pool = engine.cache.pool
    assert pool.num_used(to_kind) == num and pool.num_used_pages == len(old_pages)
    engine.cache.release_deferred()  # the tail comes back after the step
    assert pool.num_used_pages == num and pool.num_used(from_kind) == 0
    pool.check_integrity()


class CompressAt(SarathiPolicy):
    """Sarathi, but compresses every running KV request to kv-int8 once it has ``at`` output tokens."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def schedule(self, ctx):
        for r in list(ctx.running):
            if r.kind is CacheKind.KV and r.num_output_tokens == self.at:
                assert ctx.compress(r, CacheKind.KV_INT8)
                assert not ctx.upgrade(r)  # one kind change a step
        super().schedule(ctx)


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_generation_goes_on_after_a_compression_in_place(checkpoint, shape, monkeypatch):
    path = checkpoint(shape)
    kw = dict(dtype="float32", num_pages=60, calibrate_rho=False, policy="sarathi", cache_kinds=["kv-int8"],
              cache_ratio=0.0, max_num_batched_tokens=128)
    prompts = [_prompt(n, seed=n) for n in (40, 90, 130)]
    never = LLM(path, **kw).generate(prompts, GREEDY)
    llm = LLM(path, **kw)
    llm.adjust_cache_ratio(1.0)  # kv-int8 offered; sarathi's new requests still get KV pages here:
    monkeypatch.setattr(SchedulingContext, "default_kind", lambda self: CacheKind.KV)
    llm.set_scheduler(CompressAt(at=8))
    compressed = llm.generate(prompts, GREEDY)
    for a, b in zip(never, compressed):
        assert b.metrics.cache_kind == "kv-int8" and b.metrics.num_compressions == 1
        assert len(b.outputs[0].token_ids) == 24
        assert a.outputs[0].token_ids[:9] == b.outputs[0].token_ids[:9]  # the same until it was compressed
    llm.llm_engine.check_integrity()
    assert llm.cache_stats().num_free_pages == llm.cache_stats().num_pages


def _full_pool(cache_ratio: float) -> SimulatedEngine:
    config = EngineConfig(policy="apt", calibrate_rho=False, swap_space=0, cache_kinds=["kv-int8"],
                          cache_ratio=cache_ratio, max_num_batched_tokens=512)
    sim = SimulatedEngine(config, layout=MHA_LAYOUT, num_pages=40, cost=CostModel())
    for _ in range(3):  # 3 x 200 tokens: 39 of 40 KV pages once they have grown a little
        sim.add(200, 400)
    for _ in range(5):
        sim.step()
    assert all(r.kind is CacheKind.KV for r in sim.scheduler.running) and len(sim.scheduler.running) == 3
    return sim


def test_apt_compresses_running_requests_to_admit_a_waiting_one():
    sim = _full_pool(cache_ratio=1.0)
    newcomer = sim.add(150, 20)
    for _ in range(4):
        sim.step()
        sim.llm_engine.check_integrity()
    stats = sim.llm_engine.cache_stats()
    assert newcomer.first_scheduled_time is not None and stats.num_preemptions == 0
    assert sum(r.num_compressions for r in sim.scheduler.running) >= 1
    sim.run_until_idle()
    sim.llm_engine.check_integrity()


def test_apt_at_ceiling_zero_compresses_nothing():
    sim = _full_pool(cache_ratio=0.0)
    newcomer = sim.add(150, 20)
    for _ in range(4):
        sim.step()
    assert newcomer.first_scheduled_time is None  # waits for memory, as before
    assert all(r.num_compressions == 0 and r.kind is CacheKind.KV for r in sim.scheduler.running)

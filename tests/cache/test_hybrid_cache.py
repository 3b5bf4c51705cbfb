"""The hybrid cache: hidden pages beside KV pages, exact attention over both, kind changes, capacity.

The engines here run ``sarathi``, which tracks ``cache_ratio`` (new requests hidden while the share is
under it), so a ratio decides the kinds; ``apt`` (the default) chooses kinds by value under the ratio
(tests/cache/test_cache_ratio_control.py, tests/scheduler/test_cache_kinds_policy.py)."""

from __future__ import annotations

import random

import pytest
import torch

from apt_serve_ray import LLM, HybridCacheLLM, SamplingParams
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.policies.sarathi import SarathiPolicy
from policy_helpers import UpgradeAt

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)


def _prompts(n, seed=0, lo=5, hi=200):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(path, ratio, prompts, force=False, **kw):
    llm = HybridCacheLLM(path, dtype="float32", num_pages=400, cache_ratio=ratio, force_hidden=force, policy="sarathi",
                         enable_watermarks=False, max_num_batched_tokens=64, **kw)
    outs = llm.generate(prompts, PARAMS)
    pool = llm.llm_engine.cache.pool
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages
    return outs


def _assert_same(a, b, tol=1e-4):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            common = set(lx) & set(ly)
            assert len(common) >= 15
            assert max(abs(lx[t] - ly[t]) for t in common) < tol


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_cache_ratios_give_identical_outputs_on_mha_models(checkpoint, shape):
    path = checkpoint(shape)
    prompts = _prompts(6, seed=1)
    runs = {r: _run(path, r, prompts) for r in (0.0, 0.5, 1.0)}
    kinds = {r: {o.metrics.cache_kind for o in outs} for r, outs in runs.items()}
    assert kinds[0.0] == {"kv"} and kinds[1.0] == {"hidden"} and kinds[0.5] == {"kv", "hidden"}
    _assert_same(runs[0.0], runs[0.5])
    _assert_same(runs[0.0], runs[1.0])


@pytest.mark.slow
def test_forced_hidden_smollm2_matches_kv(smollm2):
    engine = smollm2.llm_engine
    assert not engine.cache_stats().hidden_supported
    ids = smollm2.get_tokenizer().encode("The three primary colours are red, yellow and")
    kv = engine.prompt_logits(ids, CacheKind.KV)
    engine.hidden_allowed = True  # what force_hidden=True does at construction; avoids a second 25 s load
    try:
        hidden = engine.prompt_logits(ids, CacheKind.HIDDEN)
        smollm2.llm_engine.scheduler.hidden_allowed = True
        smollm2.llm_engine.scheduler._compressed = (CacheKind.HIDDEN,)  # what force_hidden offers
        smollm2.adjust_cache_ratio(1.0)
        out_h = smollm2.generate(["The three primary colours are"], PARAMS)
        smollm2.adjust_cache_ratio(0.0)
        out_k = smollm2.generate(["The three primary colours are"], PARAMS)
    finally:
        engine.hidden_allowed = False
        smollm2.llm_engine.scheduler.hidden_allowed = False
        smollm2.llm_engine.scheduler._compressed = ()
        smollm2.adjust_cache_ratio(0.0)
    assert torch.allclose(kv, hidden, atol=1e-4, rtol=0)
    assert out_h[0].metrics.cache_kind == "hidden" and out_k[0].metrics.cache_kind == "kv"
    _assert_same(out_h, out_k)


def test_mixed_batches_match_each_request_alone(opt_tiny):
    prompts = _prompts(8, seed=2, lo=3, hi=150)
    alone = [_run(opt_tiny, 1.0 if i % 2 else 0.0, [p])[0] for i, p in enumerate(prompts)]
    llm = LLM(opt_tiny, dtype="float32", num_pages=400, cache_ratio=0.5, enable_watermarks=False, max_num_batched_tokens=48,
              policy="sarathi")
    llm.set_scheduler(_PinnedKinds())
    engine = llm.llm_engine
    kinds, results, mixed_steps = {}, {}, 0
    for i, p in enumerate(prompts):
        r = engine.add_request(p, PARAMS, request_id=f"{'h' if i % 2 else 'k'}{i}")
        kinds[r.request_id] = i
        engine.step()  # staggered arrivals: different lengths in every decode step
    while engine.has_unfinished_requests():
        running = {r.kind for r in engine.scheduler.running if r.is_decoding}
        mixed_steps += running == {CacheKind.KV, CacheKind.HIDDEN}
        for out in engine.step():
            if out.finished:
                results[kinds[out.request_id]] = out
    assert mixed_steps > 5
    for i in range(len(prompts)):
        assert results[i].metrics.cache_kind == ("hidden" if i % 2 else "kv")
    _assert_same([results[i] for i in range(len(prompts))], alone)


class _PinnedKinds(SarathiPolicy):
    def kind_for(self, request):
        return CacheKind.HIDDEN if request.request_id.startswith("h") else CacheKind.KV


@pytest.mark.parametrize("convert_chunk", [512, 16])  # 16: every upgrade converted in pieces (positions per piece)
@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_in_place_upgrade_mid_generation_continues_identically(checkpoint, shape, convert_chunk, monkeypatch):
    from apt_serve_ray.worker import model_runner

    monkeypatch.setattr(model_runner, "CONVERT_CHUNK", convert_chunk)
    path = checkpoint(shape)
    prompts = _prompts(4, seed=3, lo=20, hi=120)
    never = _run(path, 1.0, prompts)
    llm = LLM(path, dtype="float32", num_pages=400, cache_ratio=1.0, enable_watermarks=False, max_num_batched_tokens=64,
              policy="sarathi")
    llm.set_scheduler(UpgradeAt(at=7))
    upgraded = llm.generate(prompts, PARAMS)
    assert all(o.metrics.num_upgrades == 1 and o.metrics.cache_kind == "kv" for o in upgraded)
    _assert_same(never, upgraded)
    assert llm.cache_stats().num_free_pages == llm.cache_stats().num_pages


def test_all_hidden_admits_twice_the_tokens_of_all_kv(opt_tiny, checkpoint):
    def fill(ratio, path=opt_tiny, force=False):
        llm = LLM(path, dtype="float32", num_pages=40, cache_ratio=ratio, force_hidden=force, policy="sarathi",
                  enable_watermarks=False, max_num_batched_tokens=4096, max_num_seqs=256)
        engine = llm.llm_engine
        for p in _prompts(100, seed=4, lo=64, hi=65):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        engine.step()  # one prefill step admits whatever fits in the pool
        stats = llm.cache_stats()
        return stats.num_kv_tokens + stats.num_hidden_tokens, stats

    kv_tokens, kv_stats = fill(0.0)
    hidden_tokens, hidden_stats = fill(1.0)
    assert kv_stats.num_hidden_pages == 0 and hidden_stats.num_kv_pages == 0
    assert hidden_stats.hidden_supported
    assert (hidden_stats.kv_tokens_per_page, hidden_stats.hidden_tokens_per_page) == (16, 32)
    assert hidden_tokens >= 1.9 * kv_tokens, (hidden_tokens, kv_tokens)
    gqa_tokens, gqa = fill(0.0, checkpoint("llama-tiny-gqa"))
    assert gqa.hidden_supported is False and gqa.hidden_bytes_per_token > gqa.kv_bytes_per_token * 0.5


def test_gqa_model_never_uses_hidden_unless_forced(checkpoint):
    path = checkpoint("llama-tiny-gqa")
    llm = LLM(path, dtype="float32", num_pages=100, cache_ratio=1.0, policy="sarathi")
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3))
    stats = llm.cache_stats()
    assert stats.hidden_supported is False and stats.cache_ratio == 0.0
    assert out[0].metrics.cache_kind == "kv"
    forced = LLM(path, dtype="float32", num_pages=100, cache_ratio=1.0, force_hidden=True, policy="sarathi")
    assert forced.generate(["hello"], SamplingParams(temperature=0, max_tokens=3))[0].metrics.cache_kind == "hidden"


@pytest.mark.parametrize("policy", ["sarathi", "apt"])
def test_hybrid_cache_switched_off_uses_kv_pages_only(opt_tiny, policy):
    # An MHA model where hidden pages save memory and cache_ratio=1 asks for all-hidden (which sarathi
    # honours when the switch is on); switched off, every page stays KV, under the adaptive policy too
    # (its "hybrid cache off" baseline).
    on = LLM(opt_tiny, dtype="float32", num_pages=12, cache_ratio=1.0, policy="sarathi")
    assert on.generate(["hello"], SamplingParams(temperature=0, max_tokens=3))[0].metrics.cache_kind == "hidden"
    llm = LLM(opt_tiny, dtype="float32", num_pages=12, cache_ratio=1.0, enable_hybrid_cache=False, policy=policy,
              calibrate_rho=False, max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.hidden_allowed is False and llm.cache_stats().cache_ratio == 0.0
    kinds = set()
    for prompt in _prompts(6, seed=3, lo=20, hi=60):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        kinds.add(llm.cache_stats().num_hidden_pages)
    assert kinds == {0}
    stats = llm.cache_stats()
    assert stats.num_free_pages == stats.num_pages


def test_pool_integrity_after_mixed_workload_with_aborts(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=30, cache_ratio=0.5, max_num_batched_tokens=64, policy="sarathi")
    engine = llm.llm_engine
    rng = random.Random(5)
    ids = []
    for step in range(120):
        if step < 60 and rng.random() < 0.5:
            ids.append(engine.add_request(_prompts(1, seed=step, lo=5, hi=80)[0],
                                          SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True)).request_id)
        if ids and rng.random() < 0.15:
            engine.abort_request(ids[rng.randrange(len(ids))])
        engine.step()
        engine.cache.pool.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.cache_stats()
    assert stats.num_free_pages == stats.num_pages and stats.num_kv_pages == stats.num_hidden_pages == 0


def test_cache_stats_and_runtime_ratio(opt_tiny):
    llm = HybridCacheLLM(opt_tiny, dtype="float32", num_pages=50, cache_ratio=0.3, policy="sarathi")
    s = llm.cache_stats()
    assert s.cache_ratio == 0.3 and s.hidden_supported
    assert s.hidden_bytes_per_token * 2 == s.kv_bytes_per_token
    llm.adjust_cache_ratio(0.8)
    assert llm.cache_stats().cache_ratio == 0.8
    with pytest.raises(ValueError, match="cache_ratio"):
        llm.adjust_cache_ratio(-0.1)
    assert (s.num_pages, s.num_free_pages, s.num_kv_pages, s.num_hidden_pages, s.hidden_share) == (50, 50, 0, 0, 0.0)

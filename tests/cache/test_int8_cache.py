"""INT8 cache pages (kv-int8, hidden-int8): what a write stores, what attention reads, and the engine
over them -- accuracy against the KV cache, mixed batches, upgrades to KV, whole generations.

The bound on logits (``_MAX_LOGIT_ERROR``, a share of the KV logits' standard deviation) is measured,
not derived: quantisation moves each stored element by at most s/2 = max|group| / 254 (0.4% of its
group's largest value); over 8 prompts of 20-250 tokens on the tiny random models here that moved
logits by at most 4% (float32) and 7% (bfloat16) of their spread (0.026 / 0.047 on OPT-tiny, whose
logits have a standard deviation of 0.64), and greedy top-1 agreed on >= 92.5% of positions.
"""

from __future__ import annotations

import random

import pytest
import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.attention import AttentionMetadata, DecodeGroup, KVProjection, SlotWrite, make_backend
from apt_serve_ray.attention.backend import read_kv
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.quant import dequantize, quantize
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.output import ScheduledChunk
from apt_serve_ray.scheduler.policies.sarathi import SarathiPolicy
from policy_helpers import UpgradeAt

INT8 = (CacheKind.KV_INT8, CacheKind.HIDDEN_INT8)
ALL_KINDS = ("hidden", "kv-int8", "hidden-int8")
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=20)
_MAX_LOGIT_ERROR = 0.15  # of the KV logits' standard deviation: ~2x the worst measured


def _prompts(n, seed=0, lo=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _llm(path, dtype="float32", backend="torch", **kw):
    kw = {"num_pages": 120, "cache_ratio": 1.0, "enable_watermarks": False, "max_num_batched_tokens": 64, **kw}
    return LLM(path, dtype=dtype, attention_backend=backend, policy="sarathi", **kw)


# 1. Pages: what is written, what is read ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_int8_writes_store_the_quantisation_reference_and_decode_reads_it(dtype, backend):
    g = torch.Generator().manual_seed(0)
    heads, dim, hid = 4, 16, 64
    layout = CacheLayout(num_layers=1, num_kv_heads=heads, head_dim=dim, hidden_size=hid, block_size=16,
                         dtype_bytes=torch.finfo(dtype).bits // 8)
    storage = CacheStorage(layout, 6, "cpu", dtype)
    for b in storage.bytes:  # stale bytes of any kind: as floats, some are NaN or inf
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    before = storage.bytes[0].clone()
    attention = make_backend(backend, torch.device("cpu"))
    # Two kv-int8 pages (1, 2) and one hidden-int8 page (4), every slot written, rows in a random order.
    kv_slots = [(p, o) for p in (1, 2) for o in range(layout.tokens_per_page(CacheKind.KV_INT8))]
    hid_slots = [(4, o) for o in range(layout.tokens_per_page(CacheKind.HIDDEN_INT8))]
    n = len(kv_slots) + len(hid_slots)
    k, v = (torch.randn(n, heads, dim, generator=g).mul(3).to(dtype) for _ in range(2))
    x = torch.randn(n, hid, generator=g).mul(3).to(dtype)
    rows = torch.randperm(n, generator=g)
    kv_rows, hid_rows = rows[: len(kv_slots)], rows[len(kv_slots):]

    def slot_write(r, slots, kind):
        pages, offs = torch.tensor([s[0] for s in slots]), torch.tensor([s[1] for s in slots])
        return SlotWrite(r, pages, offs, pages * layout.tokens_per_page(kind) + offs)

    meta = AttentionMetadata(storage, n, attention, writes={
        CacheKind.KV_INT8: slot_write(kv_rows, kv_slots, CacheKind.KV_INT8),
        CacheKind.HIDDEN_INT8: slot_write(hid_rows, hid_slots, CacheKind.HIDDEN_INT8)})
    attention.write(0, k, v, x, meta)

    kv_in = torch.stack((k[kv_rows], v[kv_rows]), dim=1)  # [n, 2, H, D]
    q_ref, s_ref = quantize(kv_in.flatten(1), dim)
    pages, offs = meta.writes[CacheKind.KV_INT8].pages, meta.writes[CacheKind.KV_INT8].offsets
    assert torch.equal(storage.kv_int8[0][pages, offs].flatten(1), q_ref)
    assert torch.equal(storage.kv_int8_scale[0][pages, offs].flatten(1), s_ref)
    xq_ref, xs_ref = quantize(x[hid_rows], layout.quant_group)
    hp, ho = meta.writes[CacheKind.HIDDEN_INT8].pages, meta.writes[CacheKind.HIDDEN_INT8].offsets
    assert torch.equal(storage.hidden_int8[0][hp, ho], xq_ref)
    assert torch.equal(storage.hidden_int8_scale[0][hp, ho], xs_ref)
    for stored, scales, original, group in ((q_ref, s_ref, kv_in.flatten(1), dim),
                                            (xq_ref, xs_ref, x[hid_rows], layout.quant_group)):
        err = (dequantize(stored, scales, group) - original.float()).abs()  # within s/2 of what was written
        assert (err <= scales.repeat_interleave(group, -1) / 2 * (1 + 1e-5) + 1e-30).all()
    untouched = [0, 3, 5]  # pages nobody wrote keep their bytes: data and scales stay inside their pages
    assert torch.equal(storage.bytes[0][untouched], before[untouched])

    # Decode over those pages: padding reads page 0's garbage, which must not leak in (NaN * 0 = NaN).
    lens = [40, len(kv_slots), 3]
    table = torch.tensor([[1, 2], [2, 1], [1, 0]], dtype=torch.int32)
    group = DecodeGroup(torch.arange(3), table, torch.tensor(lens, dtype=torch.int32), max(lens),
                        layout.tokens_per_page(CacheKind.KV_INT8))
    q = torch.randn(3, heads, dim, generator=g).to(dtype)
    out = attention.decode_kv_int8(0, q, group, storage, dim**-0.5)
    proj = KVProjection(torch.randn(2 * heads * dim, hid, generator=g).div(8).to(dtype), None, heads, dim)
    hid_group = DecodeGroup(torch.arange(2), torch.tensor([[4], [4]], dtype=torch.int32),
                            torch.tensor([20, 7], dtype=torch.int32), 20, layout.tokens_per_page(CacheKind.HIDDEN_INT8))
    out_h = attention.decode_hidden_int8(0, q[:2], hid_group, storage, proj, dim**-0.5)
    # bf16: K/V, probabilities and outputs each rounded to 8 bits (~0.4% each) on values up to ~4.
    tol = 2e-5 if dtype == torch.float32 else 2e-2

    def close(out, ref):
        return (out.float() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())

    for i, n_ctx in enumerate(lens):
        tpp = layout.tokens_per_page(CacheKind.KV_INT8)
        pos = torch.arange(n_ctx)
        keys, values = read_kv(0, storage, CacheKind.KV_INT8, table[i].long()[pos // tpp], pos % tpp, None, None,
                               torch.float32)
        assert close(out[i], _attend(q[i].float(), keys, values, dim**-0.5)), i
    for i, n_ctx in enumerate((20, 7)):
        pos = torch.arange(n_ctx)
        x_ctx = dequantize(storage.hidden_int8[0][4, pos], storage.hidden_int8_scale[0][4, pos], layout.quant_group)
        kv = torch.nn.functional.linear(x_ctx, proj.w_kv.float()).unflatten(-1, (2, heads, dim))
        assert close(out_h[i], _attend(q[i].float(), kv[:, 0], kv[:, 1], dim**-0.5)), i


def _attend(q, keys, values, scale):
    """q [H, D] over keys/values [n, H, D] (one KV head per query head), float32."""
    probs = torch.einsum("hd,nhd->hn", q, keys).mul(scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, values)


# 2. Accuracy against the KV cache ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_int8_prompt_logits_stay_close_to_kv(checkpoint, shape, dtype, backend):
    # Prompt logits read the whole context from the cache for the int8 kinds (their first chunk too).
    engine = _llm(checkpoint(shape), dtype, backend, cache_kinds=ALL_KINDS).llm_engine
    ids = _prompts(1, seed=1, lo=150, hi=200)[0]
    kv = engine.prompt_logits(ids, CacheKind.KV)
    for kind in INT8:
        logits = engine.prompt_logits(ids, kind)
        err = (logits - kv).abs().max()
        assert 0 < err < _MAX_LOGIT_ERROR * kv.std(), (kind, err)
        assert (logits.argmax(-1) == kv.argmax(-1)).float().mean() >= 0.85, kind
    engine.cache.pool.check_integrity()


def test_prompt_logits_equal_token_by_token_decoding(opt_tiny):
    # Chunking does not change what an int8 request sees: one chunk == one token per step.
    engine = _llm(opt_tiny, cache_kinds=ALL_KINDS).llm_engine
    ids = _prompts(1, seed=2, lo=24, hi=25)[0]
    for kind in INT8:
        request = engine.make_request(list(ids), SamplingParams(max_tokens=1))
        assert engine.cache.allocate(request, len(ids), kind)
        rows = []
        for _ in ids:
            rows.append(engine.runner.logits_for_all_rows([ScheduledChunk(request, 1)]))
            request.num_computed_tokens += 1
        engine.cache.free(request)
        assert torch.allclose(torch.cat(rows), engine.prompt_logits(ids, kind), atol=1e-4, rtol=0)


# 3. Mixed batches --------------------------------------------------------------------------------
class _PinnedKinds(SarathiPolicy):
    """Sarathi, the kind named by the request id's prefix (``kv-int8/3``)."""

    def kind_for(self, request):
        return CacheKind(request.request_id.split("/")[0])


def _run_all(engine, requests):
    results = {}
    for rid, prompt in requests:
        engine.add_request(prompt, PARAMS, request_id=rid)
        engine.step()  # staggered arrivals: different lengths in every decode step
    kinds_seen = set()
    while engine.has_unfinished_requests():
        kinds_seen |= {r.kind for r in engine.scheduler.running if r.is_decoding}
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.cache.pool.check_integrity()
    return results, kinds_seen


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_mixed_batches_of_all_four_kinds_match_each_request_alone(opt_tiny, backend):
    prompts = _prompts(8, seed=3, lo=3, hi=90)
    requests = [(f"{kind.value}/{i}", p) for i, (kind, p) in enumerate(zip(list(CacheKind) * 2, prompts))]
    llm = _llm(opt_tiny, backend=backend, cache_kinds=ALL_KINDS, force_hidden=True, max_num_batched_tokens=48)
    llm.set_scheduler(_PinnedKinds())
    mixed, kinds_seen = _run_all(llm.llm_engine, requests)
    assert kinds_seen == set(CacheKind)
    for rid, prompt in requests:
        alone, _ = _run_all(llm.llm_engine, [(rid + "-alone", prompt)])
        a, m = alone[rid + "-alone"].outputs[0], mixed[rid].outputs[0]
        assert mixed[rid].metrics.cache_kind == rid.split("/")[0]
        assert a.token_ids == m.token_ids, rid
        for la, lm in zip(a.logprobs, m.logprobs):
            common = set(la) & set(lm)
            assert len(common) >= 15 and max(abs(la[t] - lm[t]) for t in common) < 1e-4, rid
    stats = llm.cache_stats()
    assert stats.num_free_pages == stats.num_pages


# 4. Upgrades to KV -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kv-int8", "hidden-int8"])
@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_upgrade_from_int8_writes_the_dequantised_kv_and_generation_continues(checkpoint, shape, kind):
    path, kind_ = checkpoint(shape), CacheKind(kind)
    # The upgrade itself: the new KV pages hold exactly what attention read from the int8 pages.
    engine = _llm(path, cache_kinds=(kind,)).llm_engine
    request = engine.make_request(_prompts(1, seed=4, lo=70, hi=71)[0], SamplingParams(max_tokens=1))
    assert engine.cache.allocate(request, request.num_tokens, kind_)
    engine.runner.logits_for_all_rows([ScheduledChunk(request, request.num_tokens)])
    request.num_computed_tokens = request.num_tokens
    tpp, pos = engine.layout.tokens_per_page(kind_), torch.arange(request.num_tokens)
    old = torch.tensor(request.page_ids)[pos // tpp], pos % tpp
    expected = [read_kv(layer, engine.runner.storage, kind_, *old, engine.runner.model.kv_projections[layer], pos,
                        engine.runner.dtype) for layer in range(engine.layout.num_layers)]
    plan = engine.cache.upgrade(request, request.num_tokens)
    assert plan.from_kind is kind_ and request.kind is CacheKind.KV
    engine.runner._convert(plan)
    new = torch.tensor(request.page_ids)[pos // 16], pos % 16
    for layer, (k, v) in enumerate(expected):
        kv = engine.runner.storage.kv[layer][new]
        assert torch.equal(kv[:, 0], k) and torch.equal(kv[:, 1], v)
    engine.cache.release_deferred()
    engine.cache.free(request)
    engine.cache.pool.check_integrity()
    assert engine.cache.pool.num_free_pages == engine.cache.pool.num_pages

    # In generation: every request upgraded once mid-way, and its tokens continue as if it had not.
    prompts = _prompts(3, seed=5, lo=20, hi=100)
    never = _llm(path, cache_kinds=(kind,)).generate(prompts, PARAMS)
    llm = _llm(path, cache_kinds=(kind,))
    llm.set_scheduler(UpgradeAt(at=6))
    upgraded = llm.generate(prompts, PARAMS)
    for a, b in zip(never, upgraded):
        assert a.metrics.cache_kind == kind and b.metrics.cache_kind == "kv" and b.metrics.num_upgrades == 1
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm.llm_engine.cache.pool.check_integrity()
    assert llm.cache_stats().num_free_pages == llm.cache_stats().num_pages


# 5. Whole generations in one int8 kind -----------------------------------------------------------
@pytest.mark.parametrize("kind,dtype,backend", [("kv-int8", "float32", "torch"), ("kv-int8", "bfloat16", "auto"),
                                                ("hidden-int8", "bfloat16", "torch"),
                                                ("hidden-int8", "float32", "auto")])
def test_generation_in_one_int8_kind_runs_to_completion(llama_tiny, kind, dtype, backend):
    llm = _llm(llama_tiny, dtype, backend, cache_kinds=(kind,), num_pages=14)
    engine = llm.llm_engine
    assert llm.cache_stats().compressed_kinds == (kind,)
    for prompt in _prompts(8, seed=6, lo=60, hi=150):  # more than 14 pages hold: preemptions too
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.finished or len(out.outputs[0].token_ids) == 40
        stats = llm.cache_stats()
        assert sum(stats.pages_by_kind.values()) == stats.pages_by_kind[kind]  # no other kind
        peak = max(peak, stats.pages_by_kind[kind])
        engine.cache.pool.check_integrity()
    tpp = llm.cache_stats().tokens_per_page_by_kind[kind]
    assert tpp > 16 and peak > 0 and llm.cache_stats().num_preemptions > 0
    assert llm.cache_stats().num_free_pages == llm.cache_stats().num_pages

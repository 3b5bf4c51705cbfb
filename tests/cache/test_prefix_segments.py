"""A shared prefix in one kind in front of a request's own pages in another: a compression in place
keeps the pages other requests share (a KV system prompt in front of a kv-int8 conversation), and the
kernels attend over both segments as one context.

Checked against one-kind references: a hidden or KV segment is exact, so the logits are the KV cache's;
an int8 segment moves them within the int8 kinds' measured bound (``test_int8_cache.py``)."""

from __future__ import annotations

import random

import pytest
import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.output import ScheduledChunk
from apt_serve_ray.scheduler.policies.sarathi import SarathiPolicy

KV, HIDDEN, KV_INT8, HIDDEN_INT8 = CacheKind.KV, CacheKind.HIDDEN, CacheKind.KV_INT8, CacheKind.HIDDEN_INT8
_MAX_LOGIT_ERROR = 0.15  # of the KV logits' standard deviation (test_int8_cache.py)


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 30000) for _ in range(n)]


def _engine(path, backend, **kw):
    return LLM(path, dtype="float32", attention_backend=backend, policy="sarathi", num_pages=96, cache_ratio=1.0,
               cache_kinds=["hidden", "kv-int8", "hidden-int8"], force_hidden=True, enable_watermarks=False,
               calibrate_rho=False, swap_space=0, max_num_batched_tokens=256, **kw).llm_engine


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("prefix_kind, own_kind", [(KV, HIDDEN), (HIDDEN, KV), (KV, KV_INT8), (HIDDEN, HIDDEN_INT8)],
                         ids=lambda k: k.value)
def test_a_prefix_in_one_kind_and_the_rest_in_another_attend_as_one_context(checkpoint, shape, backend,
                                                                            prefix_kind, own_kind):
    engine = _engine(checkpoint(shape), backend)
    lay, pool = engine.layout, engine.cache.pool
    prefix_pages = 3
    first = prefix_pages * lay.tokens_per_page(prefix_kind)  # whole pages of the prefix kind
    ids = _tokens(first + 41, 7)
    reference = engine.prompt_logits(ids, KV)

    # The prefix, computed by another request in its kind.
    owner = engine.make_request(ids[:first] + [1], SamplingParams(max_tokens=1))
    assert engine.cache.allocate(owner, first, prefix_kind)
    engine.runner.logits_for_all_rows([ScheduledChunk(owner, first)])
    owner.num_computed_tokens = first
    engine.cache.name_computed_pages(owner)  # a cached prefix: others may take its pages
    # This request: those pages at its head, its own pages in another kind after them.
    request = engine.make_request(list(ids), SamplingParams(max_tokens=1))
    pool.take(owner.page_ids[:prefix_pages], request.request_id)
    own = pool.allocate(lay.num_pages_for(len(ids) - first, own_kind), own_kind, request.request_id)
    request.page_ids = owner.page_ids[:prefix_pages] + own
    request.kind, request.prefix_kind = own_kind, prefix_kind
    request.num_prefix_pages, request.num_prefix_tokens = prefix_pages, first
    request.num_computed_tokens = first
    engine.cache.check_integrity([owner, request])

    # A prompt chunk, then rows one at a time (decode rows), beside a one-kind request's decode row.
    rows = [engine.runner.logits_for_all_rows([ScheduledChunk(request, 30)])]
    request.num_computed_tokens += 30
    other = engine.make_request(_tokens(64, 8), SamplingParams(max_tokens=1))
    assert engine.cache.allocate(other, 64, KV)
    engine.runner.logits_for_all_rows([ScheduledChunk(other, 20)])
    other.num_computed_tokens = 20
    while request.num_computed_tokens < len(ids):
        both = engine.runner.logits_for_all_rows([ScheduledChunk(other, 1), ScheduledChunk(request, 1)])
        rows.append(both[1:])
        request.num_computed_tokens += 1
        other.num_computed_tokens += 1
    logits = torch.cat(rows)
    expected = reference[first:]
    if own_kind.is_int8:
        err = (logits - expected).abs().max()
        assert 0 < err < _MAX_LOGIT_ERROR * expected.std()
        # The exact prefix keeps them closer than a request all in the int8 kind.
        whole = engine.prompt_logits(ids, own_kind)[first:]
        assert err < (whole - expected).abs().max()
    else:
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
    for r in (request, owner, other):
        engine.cache.free(r)
    assert pool.num_used_pages == 0


class CompressAfterHit(SarathiPolicy):
    """Sarathi admitting in the base kind, compressing every running request that started from a cached
    prefix to ``kind`` once it decodes."""

    def __init__(self, kind: CacheKind) -> None:
        super().__init__()
        self.kind = kind

    def kind_for(self, request):
        return self.kind.base

    def schedule(self, ctx):
        for r in list(ctx.running):
            if r.kind is self.kind.base and r.num_output_tokens and r.num_cached_tokens and not r.num_compressions:
                assert ctx.compress(r, self.kind)
        super().schedule(ctx)


@pytest.mark.parametrize("kind", [KV_INT8, HIDDEN_INT8])
def test_a_compression_keeps_the_shared_system_prompt_and_turns_only_the_conversation(opt_tiny, kind):
    system = _tokens(96, 9)
    prompts = [system + _tokens(40, 10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    engine = _engine(opt_tiny, "auto")
    reference = LLM(opt_tiny, dtype="float32", policy="sarathi", num_pages=96, calibrate_rho=False, swap_space=0,
                    enable_prefix_caching=False).generate(prompts, params)
    engine.set_policy(CompressAfterHit(kind))
    first = engine.add_request(prompts[0], params)
    engine.step()  # the system prompt is computed and named
    others = [engine.add_request(p, params) for p in prompts[1:]]
    shared = first.page_ids[:96 // engine.layout.tokens_per_page(kind.base)]
    seen_segmented = False
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
        for r in others:
            if r.num_prefix_pages:
                seen_segmented = True
                assert r.prefix_kind is kind.base and r.kind is kind and r.page_ids[:len(shared)] == shared
                assert all(engine.cache.pool.refs(p) >= 2 for p in shared)
    assert seen_segmented and all(r.num_compressions == 1 and r.last_kind is kind for r in others)
    assert done[first.request_id].token_ids == reference[0].outputs[0].token_ids  # shared pages not rewritten
    for r, ref_out in zip(others, reference[1:]):
        ours, exact = done[r.request_id], ref_out.outputs[0]
        agree = sum(a == b for a, b in zip(ours.token_ids, exact.token_ids)) / len(exact.token_ids)
        assert agree >= 0.5, agree  # int8 in the conversation: greedy may part ways after a while
        assert ours.token_ids[0] == exact.token_ids[0]  # sampled before the compression
    assert engine.cache.pool.num_used_pages == 0

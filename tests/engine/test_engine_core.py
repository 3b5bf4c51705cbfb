"""The serving loop (``EngineCore``) behind both transports, and outputs as deltas: what streams joins to
what the offline API returns whole (tokens, text, logprobs; text detokenised off the step loop or, with
stop strings, by the engine), a step's outputs do not grow with the request, and the core checks the
books when it runs out of work."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from apt_serve_ray import LLM, AsyncLLMEngine, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams

PROMPTS = ["Once upon a time", "The list: one, two,", [5, 6, 7, 8, 9]]


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", num_pages=64, calibrate_rho=False, **kw)


async def _stream(engine: AsyncLLMEngine, prompts, params):
    async def one(p):
        ids, text, logprobs, outs = [], "", [], []
        async for out in engine.generate(p, params):
            c = out.outputs[0]
            ids += c.token_ids
            text += c.text
            logprobs += c.logprobs or []
            outs.append(out)
        return ids, text, logprobs, outs
    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def offline(opt_tiny):
    return LLM(opt_tiny, dtype="float32", num_pages=64, calibrate_rho=False)


@pytest.mark.parametrize("engine_process", [False, True])
def test_streamed_deltas_join_to_the_offline_output(opt_tiny, offline, engine_process):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    whole = offline.generate(PROMPTS, params)
    # A stop string from the middle of the first output: the engine detokenises that request itself.
    stop = whole[0].outputs[0].text[6:9]
    assert stop.strip()
    stopped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    whole_stopped = offline.generate(PROMPTS[:1], stopped)[0]
    engine = AsyncLLMEngine(_config(opt_tiny, engine_process=engine_process))
    engine.start()
    try:
        streamed = asyncio.run(_stream(engine, PROMPTS, params))
        (s_ids, s_text, _, s_outs), = asyncio.run(_stream(engine, PROMPTS[:1], stopped))
    finally:
        engine.shutdown()
    for w, (ids, text, logprobs, outs) in zip(whole, streamed):
        c = w.outputs[0]
        assert (ids, text, logprobs) == (c.token_ids, c.text, c.logprobs)
        final = outs[-1]
        assert final.finished and final.num_output_tokens == len(c.token_ids) == 12
        assert outs[0].prompt_token_ids == w.prompt_token_ids and outs[0].num_prompt_tokens == len(w.prompt_token_ids)
        assert all(o.prompt_token_ids is None for o in outs[1:])
        assert outs[0].metrics is not None and final.metrics is not None
        assert all(o.metrics is None for o in outs[1:-1])
        times = final.metrics.token_times  # one time per token, in order, none before the request arrived
        assert len(times) == 12 and times == sorted(times) and times[0] >= final.metrics.arrival_time
    assert s_text == whole_stopped.outputs[0].text and not s_text.endswith(stop)
    assert s_ids == whole_stopped.outputs[0].token_ids
    assert s_outs[-1].outputs[0].finish_reason == "stop" and s_outs[-1].outputs[0].stop_reason == stop


def test_a_delta_step_does_not_grow_with_the_request(opt_tiny):
    """What crosses the engine socket a step (the pickled outputs) stays the same size as a request
    grows when it streams deltas; cumulative outputs carry the prompt and every token each step."""
    engine = LLMEngine(_config(opt_tiny))
    prompt = list(range(5, 405))
    sizes = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, output_kind=kind), kind.value)
        per_step = []
        while engine.has_unfinished_requests():
            per_step.extend(len(pickle.dumps(out)) for out in engine.step())
        sizes[kind] = per_step
    delta, cumulative = sizes[RequestOutputKind.DELTA], sizes[RequestOutputKind.CUMULATIVE]
    assert len(delta) == len(cumulative) == 40
    middle = delta[1:-1]  # the first carries the prompt, the last the metrics
    assert max(middle) - min(middle) < 64 and max(middle) < 1000
    assert cumulative[20] > 4 * delta[20] and cumulative[-2] > cumulative[1]


def test_final_only_returns_one_whole_output(opt_tiny):
    engine = LLMEngine(_config(opt_tiny))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True,
                                                 output_kind=RequestOutputKind.FINAL_ONLY), "f")
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 9


def test_output_kind_and_detokenize_are_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="sometimes")
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["\n"], detokenize=False)
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA


def test_without_detokenize_the_engine_returns_ids_and_no_text(opt_tiny, offline):
    engine = LLMEngine(_config(opt_tiny))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False), "n")
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    expected = offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert outs[-1].outputs[0].token_ids == expected.outputs[0].token_ids and outs[-1].outputs[0].text == ""


def test_the_core_checks_the_books_when_it_runs_out_of_work(opt_tiny):
    engine = AsyncLLMEngine(_config(opt_tiny, engine_process=False))
    checks = []
    real = engine.engine.check_integrity
    engine.engine.check_integrity = lambda: (checks.append(1), real())[1]
    engine.start()
    try:
        asyncio.run(_stream(engine, PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True)))
        for _ in range(100):
            if checks:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert checks and engine.check_health() is None

        def broken():
            raise AssertionError("page 3 is owned twice")

        engine.engine.check_integrity = broken  # a pool that lost its books: the loop stops, loudly
        asyncio.run(_stream(engine, PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True)))
        for _ in range(100):
            if engine._error is not None:
                break
            asyncio.run(asyncio.sleep(0.02))
        with pytest.raises(RuntimeError, match="page 3 is owned twice"):
            engine.check_health()
    finally:
        engine.shutdown()

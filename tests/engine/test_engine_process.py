"""The async engine with its step loop in a process of its own: same outputs as in-process, bad input
as a ValueError, aborts that free pages, metrics replayed into the parent, and a dead engine process
that ends every stream with an error instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from apt_serve_ray import AsyncLLMEngine, EngineConfig, SamplingParams
from apt_serve_ray.engine.async_engine import EngineDeadError
from apt_serve_ray.engine.process import EngineObservers
from apt_serve_ray.observability.metrics import InMemoryMetrics

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
PROMPTS = [[5, 6, 7, 8], [11, 12, 13], list(range(20, 60))]


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", num_pages=64, calibrate_rho=False, **kw)


async def _collect(engine, prompts, params=PARAMS):
    async def one(p):
        return [t for o in [o async for o in engine.generate(p, params)] for t in o.outputs[0].delta_token_ids]
    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def process_engine(opt_tiny):
    metrics = InMemoryMetrics()
    engine = AsyncLLMEngine(_config(opt_tiny, engine_process=True), metrics_backend=metrics,
                            observers=EngineObservers(metric_tags={"model": "m", "replica": "r"}, tracker=True))
    engine.start()
    yield engine, metrics
    engine.shutdown()


def test_engine_process_gives_the_in_process_tokens(opt_tiny, process_engine):
    engine, _ = process_engine
    assert engine.engine is None and engine.process.is_alive()
    local = AsyncLLMEngine(_config(opt_tiny, engine_process=False))
    local.start()
    try:
        assert asyncio.run(_collect(engine, PROMPTS)) == asyncio.run(_collect(local, PROMPTS))
    finally:
        local.shutdown()


def test_engine_process_bad_input_abort_metrics_and_timeline(process_engine):
    engine, metrics = process_engine

    async def run():
        with pytest.raises(ValueError, match="prompt: token ids"):
            async for _ in engine.generate([10**7], PARAMS):
                pass
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        await stream.aclose()  # closing the stream aborts the request in the engine process

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while engine.cache_stats().num_free_pages != engine.cache_stats().num_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cache_stats().num_free_pages == engine.cache_stats().num_pages
    finished = metrics.values.get("apt_serve_requests_total", {})
    assert sum(finished.values()) >= 1  # recorded in the engine process, replayed here
    timeline = engine.memory_timeline()
    assert timeline["series"]["kv"] and max(timeline["series"]["kv"]) > 0


def test_a_dead_engine_process_ends_every_stream_with_an_error(opt_tiny):
    engine = AsyncLLMEngine(_config(opt_tiny, engine_process=True))
    engine.start()

    async def run():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=10_000, ignore_eos=True))
        await anext(stream)
        os.kill(engine.process.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def test_engine_process_start_up_errors_name_the_field():
    with pytest.raises(ValueError, match="model"):
        AsyncLLMEngine(EngineConfig(model="no-such-model-anywhere", engine_process=True))


@pytest.mark.parametrize("in_process", [False, True])
def test_adapters_load_and_unload_at_run_time_between_steps(opt_tiny, tmp_path, in_process):
    """``AsyncLLMEngine.add_lora`` / ``remove_lora`` run on the engine's loop, in its process or this one;
    a request then names the adapter, and gets what the offline engine gives with it."""
    from apt_serve_ray import LLM
    from tests.models.test_lora import _peft

    _peft(opt_tiny, str(tmp_path / "a"), ["q_proj", "v_proj"], r=8, alpha=16, seed=1)
    engine = AsyncLLMEngine(_config(opt_tiny, engine_process=not in_process, max_loras=1, max_lora_rank=8))
    engine.start()
    try:
        async def run():
            assert await engine.add_lora("a", str(tmp_path / "a")) == {"a": str(tmp_path / "a")}
            with pytest.raises(ValueError, match="already loaded"):
                await engine.add_lora("a", str(tmp_path / "a"))
            outs = [o async for o in engine.generate(PROMPTS[0], PARAMS, lora_name="a")]
            assert await engine.remove_lora("a") == {}
            with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
                [o async for o in engine.generate(PROMPTS[0], PARAMS, lora_name="a")]
            return [t for o in outs for t in o.outputs[0].delta_token_ids]

        got = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        engine.shutdown()
    offline = LLM(opt_tiny, dtype="float32", num_pages=64, calibrate_rho=False, max_loras=1, max_lora_rank=8,
                  lora_modules=(f"a={tmp_path / 'a'}",))
    assert got == offline.generate([PROMPTS[0]], PARAMS, lora_name="a")[0].outputs[0].token_ids

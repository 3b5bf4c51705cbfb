"""The engine for servers: an ``EngineCore`` steps continuously; callers submit requests and iterate
their outputs as ``async`` generators; a caller that stops iterating aborts its request.

The core runs on a thread of this process (``ThreadTransport``), or (``EngineConfig.engine_process``)
in a process of its own, which keeps the step loop's Python off this process's GIL
(``engine/process.py``). Both speak the same messages (``engine/core.py``), so what this class does
is the same either way: send commands, and hand each message that comes back to the stream it
belongs to, through the stream's event loop (``call_soon_threadsafe``). Only the core touches the
engine's state.

Outputs stream as deltas (``RequestOutputKind.DELTA``: the new token ids, text and logprobs; the
prompt on the first output, the metrics on the first and the last), so a step costs what it made,
not the length of every running request. A request without stop strings is detokenised here, in
the caller's event loop, instead of on the step loop (the same incremental detokeniser, so the same
text); one with stop strings is detokenised by the engine, which must see the text to stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import uuid
from collections import deque
from typing import AsyncIterator

from apt_serve_ray.config import EngineConfig, check_share
from apt_serve_ray.engine.detokenizer import IncrementalDetokenizer
from apt_serve_ray.engine.llm_engine import LLMEngine
from apt_serve_ray.engine.core import EngineCore, ThreadTransport, timeline_of
from apt_serve_ray.engine.process import EngineObservers, EngineProcess, MetricsReplay, attach_observers
from apt_serve_ray.engine.llm import apply_chat_template
from apt_serve_ray.engine.outputs import RequestOutput
from apt_serve_ray.sampling.params import RequestOutputKind, SamplingParams
from apt_serve_ray.engine.stats import CacheStats

logger = logging.getLogger("apt_serve_ray")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    """``observers``: what to observe in the engine (metrics into ``metrics_backend``, spans, the
    memory timeline), wherever the engine runs."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 observers: EngineObservers | None = None, metrics_backend=None) -> None:
        self.config = engine.config if engine is not None else config
        self.in_process = engine is not None or not self.config.engine_process
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.loop_thread_id: int | None = None  # native id, once the loop runs (in-process mode)
        self._error: BaseException | None = None
        self._step_times: deque[float] = deque(maxlen=32)
        self._tokenizer = None
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._tokens = itertools.count()
        self._metrics_replay = None
        if self.in_process:
            self.engine: LLMEngine | None = engine or LLMEngine(config)
            self.process: EngineProcess | None = None
            self._tracker = attach_observers(self.engine, observers, metrics_backend)
            self._transport: ThreadTransport | None = ThreadTransport()
            self._core: EngineCore | None = EngineCore(self.engine, self._on_message, self._tracker)
            self._cache: CacheStats = self.engine.cache_stats()
            self._max_model_len = self.engine.max_model_len
        else:
            self.engine = None
            self.process = EngineProcess(config, observers)
            self._tracker = self._transport = self._core = None
            self._cache = self.process.info["cache"]
            self._max_model_len = self.process.info["max_model_len"]
            self.tokenizer  # noqa: B018 - loaded now: streams detokenise here, and the first must not wait for it
            defs = self.process.info["metric_defs"]
            if metrics_backend is not None and defs:
                self._metrics_replay = MetricsReplay(metrics_backend, defs)

    @property
    def tokenizer(self):
        if self.engine is not None:
            return self.engine.tokenizer
        if self._tokenizer is None:
            from apt_serve_ray.models.loader import load_tokenizer, resolve_model

            self._tokenizer = load_tokenizer(resolve_model(self.config.model), self.config.tokenizer)
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # Lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            target, name = (self._run, "apt-engine-loop") if self.in_process else (self._read, "apt-engine-reader")
            self._thread = threading.Thread(target=target, name=name, daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._send("stop")
        if self.process is not None:
            self.process.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine loop thread is not running")
        if self.process is not None and not self.process.is_alive() and not self._stopping:
            raise EngineDeadError("engine process is not running")

    # Requests -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, request_id: str | None = None,
        **request_options,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as deltas (``RequestOutputKind.DELTA``: ``outputs[0].token_ids``,
        ``text`` and ``logprobs`` hold what is new, as do ``delta_token_ids`` / ``delta_text``; the
        counts are whole), the last with ``finished=True``. A bad request raises ValueError at the
        first iteration. ``request_options``: ``LLMEngine.make_request``'s (``priority``,
        ``ttft_slo_ms``, ``tbt_slo_ms``, ``trace_context``, ``service_class``)."""
        self.check_health()
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(sp).__name__}")
        here = sp.detokenize and not sp.stop_strings  # detokenised here, off the step loop
        sp = dataclasses.replace(sp, output_kind=RequestOutputKind.DELTA, detokenize=sp.detokenize and not here)
        detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens, [], sp.include_stop_str_in_output) \
            if here else None
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
        self._send("add", prompt, sp, rid, request_options)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if detok is not None:
                    c = item.outputs[0]
                    for token in c.token_ids:
                        detok.add_token(token)
                    c.text = c.delta_text = detok.take_delta(finished)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    # Control --------------------------------------------------------------------------------------
    def set_cache_ratio(self, ratio: float) -> None:
        self._send("ratio", check_share("cache_ratio", ratio))  # checked here: the caller gets the error

    def set_admission(self, open_: bool) -> None:
        self._send("admission", bool(open_))

    def _send(self, *msg) -> None:
        if self.process is None:
            self._transport.put(msg)
            return
        try:
            self.process.send(*msg)
        except (OSError, EOFError):  # the engine process is gone; check_health says so
            pass

    def memory_timeline(self, timeout_s: float = 10.0) -> dict:
        """The cache-memory timeline (``observers.tracker``): series, crossings and watermarks."""
        if self.process is None:
            return timeline_of(self._tracker)
        return self._query("memory_timeline", timeout_s)

    def engine_process_spans(self, timeout_s: float = 10.0) -> list[dict]:
        """Spans kept by the engine process under the "memory" tracing exporter ([] in-process: they
        are this process's own)."""
        return [] if self.process is None else self._query("finished_spans", timeout_s)

    def _query(self, name: str, timeout_s: float):
        return self._ask(timeout_s, name, "query", name)

    def _ask(self, timeout_s: float, what: str, op: str, *args):
        """Send ``(op, token, *args)`` to the core (in this process or the engine's) and wait for its reply."""
        token, done = next(self._tokens), threading.Event()
        box: list = []
        self._replies[token] = (done, box)
        try:
            self._send(op, token, *args)
            if not done.wait(timeout_s):
                self.check_health()
                raise TimeoutError(f"the engine did not answer {what} within {timeout_s} s")
            return box[0]
        finally:
            self._replies.pop(token, None)

    # LoRA adapters (run between steps, on the engine's loop) ----------------------------------------
    async def add_lora(self, name: str, path: str, timeout_s: float = 120.0) -> dict[str, str]:
        """Load the PEFT adapter in the folder ``path`` as ``name``; the adapters loaded after it
        ({name: path}). A ``ValueError`` naming the field when it cannot be (``LLMEngine.add_lora``)."""
        return await self._lora("add", name, path, timeout_s)

    async def remove_lora(self, name: str, timeout_s: float = 60.0) -> dict[str, str]:
        """Unload ``name`` (requests running with it finish with it); the adapters left."""
        return await self._lora("remove", name, None, timeout_s)

    async def _lora(self, action: str, name: str, path, timeout_s: float) -> dict[str, str]:
        self.check_health()
        status, value = await asyncio.to_thread(self._ask, timeout_s, f"lora {action}", "lora", action, name, path)
        if status == "error":
            raise ValueError(value)
        return value

    def cache_stats(self) -> CacheStats:
        """The latest snapshot of the engine's cache and queues (after its last step or command)."""
        return self._cache

    @property
    def step_time_ms(self) -> float:
        """The mean of the engine's recent steps (0 before the first)."""
        return 1000.0 * sum(self._step_times) / len(self._step_times) if self._step_times else 0.0

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # What comes back ------------------------------------------------------------------------------
    def _run(self) -> None:
        """In-process: the core on this thread; its messages are handled as it sends them."""
        self.loop_thread_id = threading.get_native_id()
        if self.config.cpu_affinity:
            from apt_serve_ray.worker.cpu_affinity import pin_current_thread

            if pin_current_thread(self.config.cpu_affinity):
                logger.info("engine loop thread pinned to CPUs %s", list(self.config.cpu_affinity))
        self._core.run(self._transport.receive)

    def _read(self) -> None:
        """Engine-process mode: handle what the engine process sends, until it ends."""
        try:
            while True:
                self._on_message(self.process.conn.recv())
        except (EOFError, OSError) as exc:
            if not self._stopping:
                logger.error("engine process ended: %s", exc)
                self._fail(RuntimeError("engine process exited"))

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, self._cache, step_s, metric_ops = msg
            if step_s:
                self._step_times.append(step_s)
            if metric_ops and self._metrics_replay is not None:
                self._metrics_replay.apply(metric_ops)
            for out in outputs:
                self._deliver(out.request_id, out)
        elif kind == "cache":
            self._cache = msg[1]
        elif kind == "invalid":
            self._deliver(msg[1], ValueError(msg[2]))
        elif kind == "reply":
            entry = self._replies.get(msg[1])
            if entry is not None:
                entry[1].append(msg[2])
                entry[0].set()
        elif kind == "died":
            self._fail(RuntimeError(msg[1].strip().splitlines()[-1] if msg[1].strip() else "engine loop died"))

    def _fail(self, exc: BaseException) -> None:
        """The core is gone: every open stream ends with an error."""
        self._error = exc
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._deliver(rid, EngineDeadError(f"engine died: {exc}"))

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: it is gone, drop the request
                self.abort(request_id)

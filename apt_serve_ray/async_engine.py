"""The engine for servers: a loop runs ``step()`` continuously; callers submit requests and iterate
their outputs as ``async`` generators; a caller that stops iterating aborts its request.

The loop is a thread of this process, or (``EngineConfig.engine_process``) a process of its own,
which keeps the step loop's Python off this process's GIL (``engine_process.py``). Either way only
the loop touches the engine's state: other threads hand it work (an inbox, or the pipe) and receive
outputs through their event loop (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from typing import AsyncIterator

from apt_serve_ray.config import EngineConfig, check_share
from apt_serve_ray.engine import LLMEngine
from apt_serve_ray.engine_process import EngineObservers, EngineProcess, MetricsReplay, attach_observers, timeline_of
from apt_serve_ray.llm import apply_chat_template
from apt_serve_ray.outputs import RequestOutput
from apt_serve_ray.sampling_params import SamplingParams
from apt_serve_ray.stats import CacheStats

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
        self._inbox: deque = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop_thread_id: int | None = None  # native id, once the loop runs (in-process mode)
        self._error: BaseException | None = None
        self._step_times: deque[float] = deque(maxlen=32)
        self._tokenizer = None
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._tokens = itertools.count()
        if self.in_process:
            self.engine: LLMEngine | None = engine or LLMEngine(config)
            self.process: EngineProcess | None = None
            self._tracker = attach_observers(self.engine, observers, metrics_backend)
            self._cache: CacheStats = self.engine.cache_stats()
            self._max_model_len = self.engine.max_model_len
        else:
            self.engine = None
            self.process = EngineProcess(config, observers)
            self._tracker = None
            self._cache = self.process.info["cache"]
            self._max_model_len = self.process.info["max_model_len"]
            defs = self.process.info["metric_defs"]
            self._metrics_replay = MetricsReplay(metrics_backend, defs) if metrics_backend is not None and defs else None

    @property
    def tokenizer(self):
        if self.engine is not None:
            return self.engine.tokenizer
        if self._tokenizer is None:
            from apt_serve_ray.model_loader import load_tokenizer, resolve_model

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
        self._stop.set()
        self._wake.set()
        if self.process is not None:
            self.process.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise EngineDeadError("engine loop thread is not running")
        if self.process is not None and not self.process.is_alive() and not self._stop.is_set():
            raise EngineDeadError("engine process is not running")

    # Requests -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, request_id: str | None = None,
        **request_options,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one ``RequestOutput`` per new token (``delta_text``/``delta_token_ids`` hold what is
        new), the last with ``finished=True``. Raises ValueError at once for bad input.
        ``request_options``: ``LLMEngine.make_request``'s (``priority``, ``ttft_slo_ms``, ``tbt_slo_ms``,
        ``trace_context``, ``service_class``)."""
        self.check_health()
        if self.in_process:
            request = self.engine.make_request(prompt, sampling_params, request_id, **request_options)
            rid = request.request_id
        else:  # validated in the engine process: a bad request comes back as the stream's first item
            rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            if self.in_process:
                self._inbox.append(("add", request))
        if self.process is not None:
            self.process.send("add", prompt, sampling_params, rid, request_options)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    # Control --------------------------------------------------------------------------------------
    def set_cache_ratio(self, ratio: float) -> None:
        self._command("ratio", check_share("cache_ratio", ratio))  # checked here: the caller gets the error

    def set_admission(self, open_: bool) -> None:
        self._command("admission", bool(open_))

    def _command(self, op: str, arg) -> None:
        if self.process is not None:
            try:
                self.process.send(op, arg)
            except (OSError, EOFError):  # the engine process is gone; check_health says so
                pass
            return
        with self._lock:
            self._inbox.append((op, arg))
        self._wake.set()

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
        token, done = next(self._tokens), threading.Event()
        box: list = []
        self._replies[token] = (done, box)
        try:
            self.process.send("query", token, name)
            if not done.wait(timeout_s):
                raise TimeoutError(f"engine process did not answer the {name} query")
            return box[0]
        finally:
            self._replies.pop(token, None)

    def cache_stats(self) -> CacheStats:
        """The latest snapshot of the engine's cache and queues (after its last step or command)."""
        return self._cache

    def load(self) -> dict:
        """``cache_stats()`` as the load-report dict (``CacheStats.as_load``), with the mean step time
        and the number of open streams, for routing and the controller."""
        load = self._cache.as_load()
        load["step_time_ms"] = 1000.0 * sum(self._step_times) / len(self._step_times) if self._step_times else 0.0
        load["num_streams"] = len(self._streams)
        return load

    # The loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        self.loop_thread_id = threading.get_native_id()
        if self.config.cpu_affinity:
            from apt_serve_ray.cpu_affinity import pin_current_thread

            if pin_current_thread(self.config.cpu_affinity):
                logger.info("engine loop thread pinned to CPUs %s", list(self.config.cpu_affinity))
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._cache = self.engine.cache_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                step = self.engine.last_step
                if outputs or step is not None:
                    self._step_times.append(time.perf_counter() - start)
                self._cache = step.cache if step is not None else self.engine.cache_stats()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if not outputs and step is None:
                    # Nothing could run (e.g. admission closed): do not spin.
                    self._wake.wait(timeout=0.01)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            logger.exception("engine loop died")
            self._error = exc
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(f"engine loop died: {exc!r}"))

    def _read(self) -> None:
        """Engine-process mode: deliver what the engine process sends, until it ends."""
        try:
            while True:
                msg = self.process.conn.recv()
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
                    raise RuntimeError(msg[1])
        except (EOFError, OSError, RuntimeError) as exc:
            if self._stop.is_set():
                return
            logger.error("engine process ended: %s", exc)
            self._error = exc if isinstance(exc, RuntimeError) else RuntimeError("engine process exited")
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(f"engine process died: {self._error}"))

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                op, arg = self._inbox.popleft()
            if op == "add":
                self.engine.add_request(arg)
            elif op == "abort":
                out = self.engine.abort_request(arg)
                if out is not None:
                    self._deliver(arg, out)
            elif op == "ratio":
                self.engine.adjust_cache_ratio(arg)
            elif op == "admission":
                self.engine.set_admission(arg)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: it is gone, drop the request
                self.abort(request_id)

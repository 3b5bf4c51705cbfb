"""The engine for servers: a loop thread runs ``step()`` continuously; callers submit requests and
iterate their outputs as ``async`` generators; a caller that stops iterating aborts its request.

Only the loop thread touches the engine's state. Other threads hand it work through an inbox and
receive outputs through their event loop (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.engine import LLMEngine
from apt_serve_ray.llm import apply_chat_template
from apt_serve_ray.outputs import RequestOutput
from apt_serve_ray.sampling_params import SamplingParams

logger = logging.getLogger("apt_serve_ray")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config)
        self.config = self.engine.config
        self._inbox: deque = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop_thread_id: int | None = None  # native id, once the loop runs
        self._error: BaseException | None = None
        self._load: dict = self.engine.cache_stats()
        self._step_times: deque[float] = deque(maxlen=32)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # Lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="apt-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise EngineDeadError("engine loop thread is not running")

    # Requests -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.engine.tokenizer, messages)

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, request_id: str | None = None,
        **request_options,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one ``RequestOutput`` per new token (``delta_text``/``delta_token_ids`` hold what is
        new), the last with ``finished=True``. Raises ValueError at once for bad input."""
        self.check_health()
        request = self.engine.make_request(prompt, sampling_params, request_id, **request_options)
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._inbox.append(("add", request))
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
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # Control --------------------------------------------------------------------------------------
    def set_cache_ratio(self, ratio: float) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"cache_ratio: must be a number in [0, 1], got {ratio!r}")
        with self._lock:
            self._inbox.append(("ratio", float(ratio)))
        self._wake.set()

    def set_admission(self, open_: bool) -> None:
        with self._lock:
            self._inbox.append(("admission", bool(open_)))
        self._wake.set()

    def load(self) -> dict:
        """The latest snapshot of cache and queue state, for routing and the controller."""
        load = dict(self._load)
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
                    self._load = self.engine.cache_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                if outputs or self.engine.last_step:
                    self._step_times.append(time.perf_counter() - start)
                self._load = self.engine.cache_stats()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if not outputs and not self.engine.last_step:
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

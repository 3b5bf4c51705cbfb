"""The serving loop, once: drain commands, step, send what happened, whichever transport carries them.

``AsyncLLMEngine`` runs one ``EngineCore`` either on a thread of its own process (``ThreadTransport``)
or in an engine process of its own (``engine/process.py``: a socket); both speak the same messages:

    in    ("add", prompt, params, request_id, options)  ("abort", id)  ("ratio", x)  ("admission", open)
          ("query", token, name)  ("stop",)
    out   ("step", outputs, cache, step_s, metric_ops)  ("cache", cache)  ("invalid", id, message)
          ("reply", token, value)  ("died", traceback)

``outputs`` are the engine's ``RequestOutput``s of the step, ``cache`` its ``CacheStats`` after it;
``metric_ops`` what ``RecordingMetrics`` recorded (engine process only: Ray's metrics need a Ray
worker, so the parent replays them). Requests are validated here: a bad one comes back as
``invalid``. Every accepted request ends in a ``step`` message: finished, aborted or failed.

When the engine runs out of work the core checks its bookkeeping once (``check_integrity``: every
page back, every reference count and hash right); a failure ends the loop with ``died`` rather than
serve on a pool that lost pages.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Callable, Iterable

from apt_serve_ray.scheduler.watermarks import HEAVY_WATERMARK, LIGHT_WATERMARK

logger = logging.getLogger("apt_serve_ray")


def timeline_of(tracker) -> dict:
    """The memory timeline a ``CacheTracker`` recorded (empty series without one)."""
    if tracker is None:
        return {"series": {}, "crossings": [], "light_watermark": LIGHT_WATERMARK, "heavy_watermark": HEAVY_WATERMARK}
    return tracker.timeline()


class EngineCore:
    """``send(msg)`` carries messages out; ``run(receive)`` loops until ``("stop",)`` or an error,
    ``receive(timeout_s)`` returning the commands that arrived (waiting up to ``timeout_s`` for one)."""

    IDLE_WAIT_S = 0.5  # how long an idle core waits for a command before looking again
    NOTHING_RAN_S = 0.01  # work, but nothing could run (e.g. admission closed): do not spin

    def __init__(self, engine, send: Callable[[tuple], None], tracker=None, recording=None) -> None:
        self.engine = engine
        self.send = send
        self.tracker = tracker
        self.recording = recording

    def run(self, receive: Callable[[float], Iterable[tuple]]) -> None:
        engine = self.engine
        checked = True  # the bookkeeping was checked since the engine last had work
        try:
            while True:
                for msg in receive(0.0 if engine.has_unfinished_requests() else self.IDLE_WAIT_S):
                    if self.handle(msg):
                        return
                if not engine.has_unfinished_requests():
                    if not checked:
                        engine.check_integrity()
                        checked = True
                    continue
                checked = False
                if not self.step():
                    time.sleep(self.NOTHING_RAN_S)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the other side is gone
        except BaseException:  # noqa: BLE001 - every waiting caller must hear about it
            logger.exception("engine loop died")
            try:
                self.send(("died", traceback.format_exc()))
            except (OSError, EOFError):
                pass

    def step(self) -> bool:
        """One engine step and its message; False if nothing could run."""
        start = time.perf_counter()
        outputs = self.engine.step()
        step_s = time.perf_counter() - start
        last = self.engine.last_step
        if not outputs and last is None:
            return False
        cache = last.cache if last is not None else self.engine.cache_stats()
        self.send(("step", outputs, cache, step_s, self.recording.drain() if self.recording is not None else None))
        return True

    def handle(self, msg: tuple) -> bool:
        """One command; True means stop."""
        op, engine = msg[0], self.engine
        if op == "add":
            _, prompt, params, request_id, options = msg
            try:
                engine.add_request(prompt, params, request_id, **options)
            except ValueError as exc:
                self.send(("invalid", request_id, str(exc)))
        elif op == "abort":
            out = engine.abort_request(msg[1])
            if out is not None:
                self.send(("step", [out], engine.cache_stats(), 0.0, None))
        elif op in ("ratio", "admission"):
            if op == "ratio":
                engine.adjust_cache_ratio(msg[1])
            else:
                engine.set_admission(msg[1])
            self.send(("cache", engine.cache_stats()))  # the load report must show it, idle or not
        elif op == "query":
            _, token, name = msg
            if name == "memory_timeline":
                value = timeline_of(self.tracker)
            elif name == "finished_spans":
                from apt_serve_ray.observability.tracing import finished_spans

                value = finished_spans()
            else:
                value = None
            self.send(("reply", token, value))
        elif op == "lora":  # load or unload an adapter between steps; the reply: ("ok", adapters) or ("error", why)
            _, token, action, name, path = msg
            try:
                if action == "add":
                    engine.add_lora(name, path)
                elif action == "remove":
                    engine.remove_lora(name)
                value = ("ok", engine.list_loras())
            except ValueError as exc:
                value = ("error", str(exc))
            self.send(("reply", token, value))
        elif op == "stop":
            return True
        return False


class ThreadTransport:
    """Commands to a core on a thread of this process: a queue and a wake-up (the messages out are
    delivered by the core's ``send`` directly, on its thread)."""

    def __init__(self) -> None:
        self._inbox: deque = deque()
        self._wake = threading.Event()

    def put(self, msg: tuple) -> None:
        self._inbox.append(msg)
        self._wake.set()

    def receive(self, timeout_s: float) -> list[tuple]:
        if not self._inbox and timeout_s > 0:
            self._wake.wait(timeout_s)
        self._wake.clear()
        msgs = []
        while self._inbox:
            msgs.append(self._inbox.popleft())
        return msgs

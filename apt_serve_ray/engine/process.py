"""The engine's step loop in a process of its own, behind ``AsyncLLMEngine`` (``engine_process=True``).

In a server the step loop shares its process with the transport: Ray's threads serialising every
streamed token, the replica's event loop. Its Python parts (per-layer glue, scheduling, sampling)
then wait for the GIL those threads hold. Measured through Ray Serve with 64 streams (OPT-125m bf16,
one compute thread): the same engine makes 222-229 tok/s in a process with 64 asyncio consumers and
188 in a Serve replica. vLLM runs its engine core in a separate process for this reason; this module
does the same: the child runs the ``EngineCore`` (``engine/core.py``: the loop and its messages, the
same as on a thread) over a socket, one message per step each way. Before it, the parent sends the
config and the observers; the child answers ``("ready", info)`` or ``("failed", traceback)``.

Observers that need the engine object run in the child (``EngineObservers``): the engine's metrics
are recorded there into ``RecordingMetrics`` and replayed by the parent into its real backend (Ray's
metrics need a Ray worker); the cache-memory timeline is recorded there and fetched on demand.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from apt_serve_ray.engine.core import EngineCore

logger = logging.getLogger("apt_serve_ray")


@dataclass(frozen=True)
class EngineObservers:
    """What to observe in the engine, wherever it runs (picklable: it crosses to the child)."""

    metric_tags: dict | None = None  # {"model": ..., "replica": ...}: record EngineMetrics
    tracing_exporter: str = "none"  # RequestTracer spans (in the engine's process)
    tracker: bool = False  # CacheTracker: the memory timeline
    tracker_min_interval_s: float = 0.1
    tracker_max_samples: int = 36_000


def attach_observers(engine, spec: EngineObservers | None, metrics_backend):
    """Attach ``spec``'s observers to ``engine``; returns its CacheTracker (or None)."""
    if spec is None:
        return None
    if spec.metric_tags is not None and metrics_backend is not None:
        from apt_serve_ray.observability.metrics import EngineMetrics

        engine.add_observer(EngineMetrics(metrics_backend, **spec.metric_tags))
    if spec.tracing_exporter != "none":
        from apt_serve_ray.observability.tracing import RequestTracer, configure_tracing

        provider = configure_tracing(spec.tracing_exporter, service_name="apt-serve-engine")
        if provider is not None:
            engine.add_observer(RequestTracer(provider))
    if spec.tracker:
        from apt_serve_ray.observability.tracker import CacheTracker

        return CacheTracker(engine, min_interval_s=spec.tracker_min_interval_s, max_samples=spec.tracker_max_samples)
    return None


# Metrics across the process boundary ----------------------------------------------------------------
class _Recorder:
    __slots__ = ("ops", "name")

    def __init__(self, ops: list, name: str) -> None:
        self.ops, self.name = ops, name

    def inc(self, value=1.0, tags=None) -> None:
        self.ops.append((self.name, "inc", value, tags))

    def observe(self, value, tags=None) -> None:
        self.ops.append((self.name, "observe", value, tags))

    def set(self, value, tags=None) -> None:
        self.ops.append((self.name, "set", value, tags))


class RecordingMetrics:
    """A metrics backend (``counter`` / ``histogram`` / ``gauge``) that queues every operation."""

    def __init__(self) -> None:
        self.defs: dict[str, tuple] = {}  # name -> (kind, description, boundaries, tag_keys)
        self.ops: list = []

    def counter(self, name, description="", tag_keys=()):
        self.defs[name] = ("counter", description, (), tuple(tag_keys))
        return _Recorder(self.ops, name)

    def histogram(self, name, description="", boundaries=(), tag_keys=()):
        self.defs[name] = ("histogram", description, tuple(boundaries), tuple(tag_keys))
        return _Recorder(self.ops, name)

    def gauge(self, name, description="", tag_keys=()):
        self.defs[name] = ("gauge", description, (), tuple(tag_keys))
        return _Recorder(self.ops, name)

    def drain(self) -> list:
        ops, self.ops[:] = list(self.ops), []
        return ops


class MetricsReplay:
    """Replays ``RecordingMetrics`` operations into a real backend, creating each metric once."""

    def __init__(self, backend, defs: dict[str, tuple]) -> None:
        self.metrics = {}
        for name, (kind, description, boundaries, tag_keys) in defs.items():
            if kind == "histogram":
                self.metrics[name] = backend.histogram(name, description, boundaries, tag_keys)
            else:
                self.metrics[name] = getattr(backend, kind)(name, description, tag_keys)

    def apply(self, ops) -> None:
        for name, method, value, tags in ops:
            getattr(self.metrics[name], method)(value, tags)


# The child -----------------------------------------------------------------------------------------
def _engine_main(config, spec: EngineObservers | None, conn) -> None:
    """The engine process: build the engine, then run its core over ``conn``."""
    try:
        from apt_serve_ray.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        recording = RecordingMetrics() if spec is not None and spec.metric_tags is not None else None
        tracker = attach_observers(engine, spec, recording)
        from apt_serve_ray.worker.model_runner import resolve_device

        if resolve_device(config.device).type == "cpu":
            import torch

            from apt_serve_ray.worker.cpu_affinity import bind_compute_threads

            bind_compute_threads(torch.get_num_threads(), config.bind_threads, config.cpu_affinity)
        elif config.cpu_affinity:
            from apt_serve_ray.worker.cpu_affinity import pin_current_thread

            pin_current_thread(config.cpu_affinity)
        conn.send(("ready", {"max_model_len": engine.max_model_len, "cache": engine.cache_stats(),
                             "metric_defs": recording.defs if recording is not None else {}}))
    except BaseException:  # noqa: BLE001 - the parent raises it as its own construction error
        conn.send(("failed", traceback.format_exc()))
        return

    def receive(timeout_s: float) -> list:
        msgs = []
        if conn.poll(timeout_s):
            msgs.append(conn.recv())
            while conn.poll(0):
                msgs.append(conn.recv())
        return msgs

    EngineCore(engine, conn.send, tracker, recording).run(receive)


# The parent's handle -------------------------------------------------------------------------------
@dataclass
class EngineProcess:
    """Starts the engine process and waits until it is ready (or raises its start-up error).

    The child is a fresh interpreter (``python -m apt_serve_ray.engine.process FD``) talking over a
    socket pair: not ``multiprocessing``'s spawn, which would re-run the parent's ``__main__`` (a Ray
    worker's, in a replica) in the child."""

    config: object
    spec: EngineObservers | None = None
    startup_timeout_s: float = 600.0
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        self.process = subprocess.Popen([sys.executable, "-m", "apt_serve_ray.engine.process", str(fd)],
                                        pass_fds=(fd,))
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self.send(self.config, self.spec)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.conn.poll(1.0):
            if self.process.poll() is not None:
                raise RuntimeError(f"engine process exited with code {self.process.returncode} while starting")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"engine process did not start within {self.startup_timeout_s:.0f} s")
        kind, payload = self.conn.recv()
        if kind == "failed":
            self.process.wait(timeout=10)
            error = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
            # The engine's own validation errors name the field: raise them as the same kind.
            if error.startswith("ValueError: "):
                raise ValueError(error.removeprefix("ValueError: "))
            raise RuntimeError(f"engine process failed to start:\n{payload}")
        self.info = payload
        logger.info("engine process %d ready", self.process.pid)

    def send(self, *msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.send("stop")
        except (OSError, EOFError):
            pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def _child(fd: int) -> None:
    from apt_serve_ray.worker.cpu_affinity import run_as_normal

    run_as_normal()  # the replica's Ray threads may be under SCHED_BATCH (``yield_to_engines``); not the engine
    conn = Connection(fd)
    config, spec = conn.recv()
    _engine_main(config, spec, conn)


if __name__ == "__main__":
    _child(int(sys.argv[1]))

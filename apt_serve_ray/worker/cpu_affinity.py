"""Which CPUs the engine's compute thread owns, and keeping everything else off them.

On a small CPU box every process of a Ray Serve app (proxy, router, controller, the replica's own
transport threads) competes with the engine's compute thread for the same cores, and each
interruption stretches a step. Measured on this project's 2-core machine (OPT-125m bf16, one
compute thread, through Ray Serve): pinning the engine thread to one core and everything else to
the other took the single-stream TPOT from 14.5 to 13.2 ms and saturated output from 180 to 193 tok/s.

Linux only (``os.sched_setaffinity``); elsewhere these are no-ops that say so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("apt_serve_ray")


def available_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def engine_cpus(local_rank: int, num_threads: int, cpus: list[int] | None = None) -> list[int] | None:
    """The CPUs for engine replica ``local_rank`` (on its node) running ``num_threads`` compute
    threads: consecutive blocks from the first CPU, or None when that would leave no CPU for the
    rest of the node (then nothing is pinned)."""
    cpus = available_cpus() if cpus is None else cpus
    start = local_rank * num_threads
    if num_threads < 1 or start + num_threads >= len(cpus):
        return None
    return cpus[start : start + num_threads]


def compute_cpus(num_threads: int, bind: bool, affinity=None, cpus: list[int] | None = None) -> list[int] | None:
    """The CPUs to bind ``num_threads`` compute threads to, one each (``bind_compute_threads``), or None
    to leave them as they are: not asked to, more threads than CPUs (bound, two would share one), or a
    single thread with no affinity given (nothing to keep apart)."""
    if not bind or num_threads < 1:
        return None
    pool = list(affinity) if affinity else (available_cpus() if cpus is None else list(cpus))
    if len(pool) < num_threads or (num_threads == 1 and not affinity):
        return None
    return pool[:num_threads]


def bind_compute_threads(num_threads: int, bind: bool, affinity=None) -> list[int] | None:
    """Bind this process's intra-op threads (the calling thread first) one to a CPU each, as
    ``compute_cpus`` says; where it does not bind, the calling thread is pinned to ``affinity`` (if
    any) as before. Returns the CPUs bound to, or None.

    Why: with as many compute threads as cores, Ray's processes and the Serve path keep preempting
    them, and an unbound thread can be moved onto its partner's core while the other core runs the
    intruder, so that every parallel region waits. Measured through Serve on 2 cores (bf16 OPT-125m,
    two threads, six alternated pairs): saturated output 317 -> 337 tok/s (bound ahead in five of six),
    TTFT 136 -> 132 ms (docs/benchmarks.md, issue 41's second pass). vLLM's CPU worker binds its threads
    the same way."""
    chosen = compute_cpus(num_threads, bind, affinity)
    if chosen is not None:
        from apt_serve_ray.kernels import cpu_attention

        if hasattr(os, "sched_setaffinity") and cpu_attention.is_available():
            tids = cpu_attention.bind_threads(chosen)
            logger.info("compute threads %s bound to CPUs %s", tids, chosen)
            return chosen
        logger.info("compute threads not bound to CPUs (no C++ extension, or not Linux)")
    if affinity:
        pin_current_thread(affinity)
    return None


def pin_current_thread(cpus) -> bool:
    """Pin the calling thread (and the OpenMP workers it creates later) to ``cpus``."""
    if not hasattr(os, "sched_setaffinity"):
        logger.info("CPU affinity not supported on this platform: not pinning")
        return False
    os.sched_setaffinity(0, set(cpus))  # Linux: pid 0 is the calling thread
    return True


def pin_process_threads(cpus, keep=()) -> int:
    """Pin every thread of this process but those in ``keep`` (native ids) to ``cpus``; threads
    created later inherit their creator's CPUs. Returns how many threads were moved."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return 0
    moved = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in keep:
            continue
        try:
            os.sched_setaffinity(tid, set(cpus))
            moved += 1
        except OSError:  # the thread ended meanwhile
            pass
    return moved


def other_cpus(num_engine_replicas: int, num_threads: int, cpus: list[int] | None = None) -> list[int] | None:
    """The CPUs left to everything but the engines when ``num_engine_replicas`` engine replicas of
    ``num_threads`` compute threads each share this node (None: no engine is pinned here)."""
    cpus = available_cpus() if cpus is None else cpus
    taken = {c for r in range(num_engine_replicas) for c in (engine_cpus(r, num_threads, cpus) or ())}
    rest = [c for c in cpus if c not in taken]
    return rest if taken and rest else None


# Ray's own processes on a node, by their command line: the proxy and the other actors' workers
# ("ray::..."), the raylet, the GCS, the dashboard and its agents, the log monitor.
_RAY_PROCESS_MARKS = ("ray::", "/ray/core/src/ray/", "/ray/dashboard/", "/ray/_private/", "/ray/autoscaler/")


def _ray_processes(skip=(), marks=_RAY_PROCESS_MARKS):
    """This node's Ray processes (a command line with one of ``marks``), as their /proc directories: not
    this process, its children, nor those whose command line has one of ``skip``. Linux only (empty
    elsewhere)."""
    if not os.path.isdir("/proc"):
        return
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            proc = Path("/proc", entry)
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
        if ppid != me and any(m in cmd for m in marks) and not any(k in cmd for k in skip):
            yield proc


def _each_thread(proc: Path, act) -> bool:
    """``act(tid)`` on every thread of ``proc``; False if the process ended or is not ours to change."""
    try:
        for tid in os.listdir(proc / "task"):
            act(int(tid))
    except (OSError, ValueError):
        return False
    return True


def keep_ray_processes_off(cpus, skip=("EngineReplica",)) -> int:
    """Pin every thread of this node's Ray processes (``_ray_processes``) to ``cpus``; workers the raylet
    starts later inherit its CPUs. Measured through Ray Serve on 2 cores (bf16, one compute thread,
    the engine pinned to core 0 and only the router and controller kept off it): mixed steps ran
    1.2-1.4x their prediction at the median and single steps up to 2.4x (0.62 s for a 0.26 s step),
    breaking 0.5 s gaps that in-process runs kept; the proxy, the GCS, the raylet and the dashboard
    still ran on the engine's core. Returns the processes moved. Linux only."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    return sum(_each_thread(proc, lambda tid: os.sched_setaffinity(tid, set(cpus)))
               for proc in _ray_processes(skip))


def _set_batch(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))


def yield_to_engines(marks=_RAY_PROCESS_MARKS) -> int:
    """Put every thread of this node's Ray processes (``_ray_processes``, and this process, but not its
    children: the engine's process) under ``SCHED_BATCH``; threads and workers they start later inherit
    it. The kernel then lets a batch thread that wakes wait for the next tick (4 ms at HZ=250) instead of
    preempting the thread running there: on a node where the engine computes on every core, the Serve
    app's ~2,500 timer wake-ups a second (each Ray actor's 10-ms signal check, its event loop, gRPC
    pollers) no longer each stop a compute thread, and run together when the kernel switches anyway.
    The engine's process sets itself back to ``SCHED_OTHER`` (``run_as_normal``). Measured through Serve
    on 2 cores, two compute threads (OPT-125m, seven alternated pairs; docs/benchmarks.md, issue 41's tenth
    pass): saturated output 1.11x on average, fp32's single-stream TPOT 41.6 -> 38.1 ms, bf16's 22.5 ->
    25.8 ms; issue 44's burst trace lost 2.5 and 11 points of attainment. So the app's ``yield_to_engines``
    is off by default. Returns the processes changed (this one included). Linux only."""
    if not hasattr(os, "sched_setscheduler") or not os.path.isdir("/proc/self/task"):
        return 0
    changed = int(_each_thread(Path("/proc/self"), _set_batch))
    return changed + sum(_each_thread(proc, _set_batch) for proc in _ray_processes(marks=marks))


def run_as_normal() -> bool:
    """Put the calling thread (and those it starts later) back under ``SCHED_OTHER`` if it inherited
    another policy (``yield_to_engines``' batch): the engine's process, at its start. True if changed."""
    if not hasattr(os, "sched_getscheduler") or os.sched_getscheduler(0) == os.SCHED_OTHER:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True

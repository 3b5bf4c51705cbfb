"""``cpu_affinity.yield_to_engines``: the node's Ray processes under SCHED_BATCH, the engine's process not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler") or not os.path.isdir("/proc/self/task"),
                                reason="SCHED_BATCH and /proc are Linux's")

MARK = f"apt-test-fake-ray-{os.getpid()}"  # a mark no real Ray process has


def _policy(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _sleeper(*argv: str) -> subprocess.Popen:
    script = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", script, *argv])


def test_yield_to_engines_batches_ray_processes_and_itself_not_its_children_nor_others():
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        pytest.skip("this test process does not run under SCHED_OTHER: its children would not either")
    ray_like, other = _sleeper(f"ray::{MARK}"), _sleeper("not-ray")
    # The "replica": yields, then starts a child as the replica starts the engine's process (after the yield,
    # so the child inherits SCHED_BATCH) whose run_as_normal puts it back; a child running before stays put.
    replica = textwrap.dedent(f"""
        import os, subprocess, sys
        from apt_serve_ray.worker import cpu_affinity
        before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ray::{MARK}-child"])
        changed = cpu_affinity.yield_to_engines(marks=("ray::{MARK}",))
        engine = subprocess.run([sys.executable, "-c",
            "import os; from apt_serve_ray.worker.cpu_affinity import run_as_normal; "
            "was = os.sched_getscheduler(0); changed = run_as_normal(); print(was, changed, os.sched_getscheduler(0))"],
            capture_output=True, text=True, check=True).stdout.split()
        mine = {{os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}}
        print(changed, sorted(mine), os.sched_getscheduler(before.pid), *engine)
        before.kill()
        """)
    try:
        time.sleep(0.5)  # the sleepers' threads have started
        out = subprocess.run([sys.executable, "-c", replica], capture_output=True, text=True, check=True,
                             timeout=120).stdout.split()
        changed, mine, child_before = int(out[0]), out[1], int(out[2])
        engine_was, engine_changed, engine_now = int(out[3]), out[4], int(out[5])
        assert changed == 2  # itself and the sibling with the mark
        assert mine == f"[{os.SCHED_BATCH}]"
        assert _policy(ray_like.pid) == {os.SCHED_BATCH}  # every thread of it
        assert _policy(other.pid) == {os.SCHED_OTHER}  # no mark: left alone
        assert child_before == os.SCHED_OTHER  # its own children are not Ray's processes
        assert (engine_was, engine_changed, engine_now) == (os.SCHED_BATCH, "True", os.SCHED_OTHER)
    finally:
        for p in (ray_like, other):
            p.kill()
            p.wait()


def test_run_as_normal_leaves_a_normal_thread_alone():
    from apt_serve_ray.worker.cpu_affinity import run_as_normal

    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        pytest.skip("this test process does not run under SCHED_OTHER")
    assert run_as_normal() is False
    assert os.sched_getscheduler(0) == os.SCHED_OTHER

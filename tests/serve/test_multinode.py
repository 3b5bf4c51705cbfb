"""The app on a Ray cluster of four nodes on this machine (a head and three one-CPU workers; the two
engine replicas on different workers), with the worker of one engine replica removed under load:
every request ends (finished or an explicit error, none hangs), new requests succeed within 30 s,
and a replacement replica comes back on the spare worker.

It needs a Ray cluster of its own, so it runs ``benchmarks/reliability.py multinode`` in a process of
its own; the test session's Ray instance is not touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_node_lost_under_load(opt_tiny, tmp_path):
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "benchmarks/reliability.py", "multinode", "--model", opt_tiny,
                          "--duration", "20", "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=360)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multinode.json").read_text())
    assert result["worker_nodes_hosting_engines"] == 2, result
    assert result["in_flight_at_kill"] > 0, result
    assert result["lost"] == 0, result  # every request ended: finished, or an explicit error (none hung)
    assert result["failing_for_s"] < 30.0 and result["sent_after_kill"] > 0, result
    assert result["completed"] > result["sent"] // 2, result
    assert result["replaced_after_s"] is not None, result

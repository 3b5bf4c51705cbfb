"""The header every benchmark JSON carries: what ran where (git commit, CPU and its flags, bf16 native
or not, threads, dtype, model), so that a figure can be traced to its code and machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from apt_serve_ray.worker.cpu_info import cpu_name, has_native_bf16

_REPO = Path(__file__).resolve().parents[2]


def git_state() -> str:
    """The commit the code under the benchmark came from ("+dirty" with uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True).stdout.strip()
        return (head or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> dict:
    return {"cpu": cpu_name(), "native_bf16": has_native_bf16(), "num_cpus": os.cpu_count(),
            "python": platform.python_version()}


def machine_header(**run) -> dict:
    """``{"machine", "git", "command", "run"}``: ``run`` names what the benchmark ran (threads, dtype,
    model, simulated or real...)."""
    return {"machine": machine(), "git": git_state(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "run": run}

"""The stamp every benchmark JSON carries: what ran where (git commit, CPU model and its flags, bf16
native or not, threads, dtype, model, real or simulated, date), so that a figure can be traced to its
code and machine; and ``write_json``, which writes a result with it."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from apt_serve_ray.worker.cpu_info import cpu_flags, cpu_name, has_native_bf16

_REPO = Path(__file__).resolve().parents[2]
# The CPU flags that decide how fast the kernels run (the rest of /proc/cpuinfo's list is noise here).
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni")
STAMP_FIELDS = ("git", "date", "command", "machine", "run")
RUN_FIELDS = ("threads", "dtype", "model", "simulated")


def git_state() -> str:
    """The commit the code under the benchmark came from ("+dirty" with uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    return {"cpu": cpu_name(), "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(ISA_PREFIXES)),
            "native_bf16": has_native_bf16(), "num_cpus": os.cpu_count(), "python": platform.python_version()}


def stamp(*, threads, dtype, model, simulated: bool, **run) -> dict:
    """``{"git", "date", "command", "machine", "run"}``. ``run`` names what the benchmark ran: the
    four required fields (None where one does not apply, e.g. a server started elsewhere) and any
    others."""
    return {"git": git_state(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": machine(),
            "run": {"threads": threads, "dtype": dtype, "model": model, "simulated": simulated, **run}}


def finite(value):
    """Infinities and NaNs as null (strict JSON has neither), paths and other objects as text."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()  # a numpy scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_json(path, doc: dict, header: dict, indent: int | None = 1) -> Path:
    """Write ``{**header, **doc}`` to ``path`` (its folder made), ``header`` a ``stamp``; returns the path."""
    missing = [k for k in STAMP_FIELDS if k not in header] + [k for k in RUN_FIELDS if k not in header.get("run", {})]
    if missing:
        raise ValueError(f"write_json: the header lacks {missing}: make it with stamp()")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compact = (",", ":") if indent is None else None
    path.write_text(json.dumps(finite({**header, **doc}), indent=indent, separators=compact) + "\n")
    return path


"""What this CPU is and can do, read once from /proc/cpuinfo (Linux; elsewhere: what platform says)."""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line of /proc/cpuinfo, or '' when there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo_field("flags").split())


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run at (or above) fp32 speed. Without them oneDNN emulates
    bf16 and matmuls run several times slower than in fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())

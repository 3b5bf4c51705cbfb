"""The engine process's compute threads bound one to a CPU each (``bind_threads``): which CPUs
(``worker/cpu_affinity.compute_cpus``) and the binding itself (``kernels/csrc/cpu_threads.cpp``)."""

from __future__ import annotations

import os

import pytest

from apt_serve_ray.kernels import cpu_attention as ca


def test_compute_cpus_one_thread_a_cpu_where_there_are_enough():
    from apt_serve_ray.config import EngineConfig
    from apt_serve_ray.worker.cpu_affinity import compute_cpus

    assert compute_cpus(2, True, cpus=[0, 1]) == [0, 1]
    assert compute_cpus(2, True, cpus=[0, 1, 2, 3]) == [0, 1]
    assert compute_cpus(3, True, cpus=[0, 1]) is None  # bound, two threads would share a CPU
    assert compute_cpus(1, True, cpus=[0, 1]) is None  # one thread, nothing to keep apart
    assert compute_cpus(1, True, affinity=(1,), cpus=[0, 1]) == [1]
    assert compute_cpus(2, True, affinity=(2, 3), cpus=[0, 1, 2, 3]) == [2, 3]
    assert compute_cpus(2, False, cpus=[0, 1]) is None
    assert EngineConfig(bind_threads=False).bind_threads is False
    with pytest.raises(ValueError, match="bind_threads"):
        EngineConfig(bind_threads="yes")


@pytest.mark.skipif(not ca.is_available() or not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binds two threads to two CPUs: needs the C++ kernels, Linux and two CPUs")
def test_bind_threads_puts_each_compute_thread_on_its_own_cpu():
    """In a fresh process (binding changes the caller's own affinity): every ATen thread bound to its
    CPU, the caller first; the kernels still give the same answer afterwards."""
    import subprocess
    import sys
    import textwrap

    cpus = sorted(os.sched_getaffinity(0))[:2]
    code = textwrap.dedent(f"""
        import os, threading, torch
        from apt_serve_ray.kernels import cpu_attention as ca
        torch.set_num_threads(2)
        tids = ca.bind_threads({cpus})
        assert len(tids) == 2 and len(set(tids)) == 2 and -1 not in tids, tids
        assert tids[0] == threading.get_native_id(), tids
        assert [sorted(os.sched_getaffinity(t)) for t in tids] == [[{cpus[0]}], [{cpus[1]}]]
        torch.manual_seed(0)
        q = torch.randn(37, 4, 64)
        kv = torch.randn(8, 16, 2, 4, 64)
        table = torch.randperm(8).to(torch.int32)
        if ca.prefill_supported(64, torch.float32):  # AVX-512 builds; an AVX2 build binds threads all the same
            out = ca.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], table, 40, 0.125)
            assert torch.isfinite(out).all()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]

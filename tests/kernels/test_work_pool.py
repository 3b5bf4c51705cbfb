"""The decode kernels' own threads (``kernels/csrc/work_pool.h``): the same bits as on ATen's threads, the
workers take part, one thread or the pool turned off publishes nothing, and callers on two Python threads at
once each get their own answer."""

from __future__ import annotations

import threading

import pytest
import torch

from apt_serve_ray.kernels import cpu_attention as ca

pytestmark = pytest.mark.skipif(not ca.is_available(), reason="needs the C++ kernels (a C++ toolchain)")


def _decode_case(seed: int, batch: int = 6):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs, pages = 8, 2, 64, 16, 96
    lens = torch.tensor([1 + (97 * i + seed) % 250 for i in range(batch)], dtype=torch.int32)
    kv = torch.randn(pages, bs, 2, kv_heads, dim, generator=g)
    table = torch.stack([torch.randperm(pages, generator=g)[:16] for _ in range(batch)]).to(torch.int32)
    return torch.randn(batch, heads, dim, generator=g), kv, table, lens, dim**-0.5


@pytest.fixture
def pool_restored():
    was = ca.work_pool_enable(None)
    yield
    ca.work_pool_enable(was)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_pool_gives_the_same_bits_as_atens_threads_and_its_workers_take_part(threads, pool_restored):
    case = _decode_case(1)
    ca.work_pool_enable(False)
    off = ca.kv_decode(*case, 16)
    before = ca.work_pool_stats()
    ca.work_pool_enable(True)
    results = [ca.kv_decode(*case, 16) for _ in range(200)]
    after = ca.work_pool_stats()
    for on in results:  # each item is computed whole by one thread, whichever: the same bits
        assert torch.equal(on, off)
    assert after["workers"] == 1 and after["jobs"] - before["jobs"] == 200
    assert after["joined"] > before["joined"]  # a worker took part in some of them (it joins when in time)
    torch.testing.assert_close(off, ca.kv_decode_reference(*case), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_one_thread_or_the_pool_off_publishes_nothing(threads, pool_restored):
    case = _decode_case(2)
    ca.work_pool_enable(threads == 1)  # one thread: on, and still nothing to share; two: off
    before = ca.work_pool_stats()["jobs"]
    out = ca.kv_decode(*case)
    assert ca.work_pool_stats()["jobs"] == before
    torch.testing.assert_close(out, ca.kv_decode_reference(*case), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_two_callers_at_once_each_get_their_own_answer(threads, pool_restored):
    ca.work_pool_enable(True)
    cases = [_decode_case(10 + i) for i in range(2)]
    expected = [ca.kv_decode(*c) for c in cases]
    errors: list[str] = []

    def caller(i: int) -> None:
        torch.set_num_threads(2)
        for _ in range(100):  # one holds the pool, the other goes to ATen's threads meanwhile
            if not torch.equal(ca.kv_decode(*cases[i]), expected[i]):
                errors.append(f"caller {i}: a wrong answer")
                return

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and not any(w.is_alive() for w in workers)

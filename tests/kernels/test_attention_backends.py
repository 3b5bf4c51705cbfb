"""Attention backends against the PyTorch reference: the C++ CPU kernels one by one (both cache kinds,
GQA and MHA, RoPE and learned positions, page boundaries, odd lengths, one and two threads, split
contexts), then whole engines on each backend against the reference backend (mixed batches too)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.attention import AttentionBackend, make_backend
from apt_serve_ray.kernels import cpu_attention as ca
from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention_reference as hidden_reference
from apt_serve_ray.request import CacheKind

pytestmark = pytest.mark.skipif(not ca.is_available(), reason="the C++ CPU attention kernels cannot be built here")

LENGTHS = [1, 15, 16, 17, 63, 100, 250]  # inside, at and across page boundaries


def _table(lens, tokens_per_page, num_pages, g):
    max_pages = max((n + tokens_per_page - 1) // tokens_per_page for n in lens)
    return torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in lens]).to(torch.int32)


def _tolerance(dtype):
    return 2e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 32), (6, 1, 40), (2, 2, 128), (4, 4, 16)])
@pytest.mark.parametrize("part_tokens", [0, 16, 48])
def test_kv_decode_matches_reference(dtype, heads, kv_heads, dim, part_tokens, threads):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    block_size, num_pages = 16, 80
    kv = torch.randn(num_pages, block_size, 2, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(len(LENGTHS), heads, dim, generator=g).to(dtype)
    table, lens = _table(LENGTHS, block_size, num_pages, g), torch.tensor(LENGTHS, dtype=torch.int32)
    out = ca.kv_decode(q, kv, table, lens, dim**-0.5, part_tokens)
    ref = ca.kv_decode_reference(q.float(), kv.float(), table, lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max() < _tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part_tokens", [0, 32])
def test_two_segments_decoded_apart_and_merged_by_their_lse_are_one_context(dtype, part_tokens, threads):
    """A shared KV prefix and a request's own pages after it (kv or kv-int8), each through its decode
    kernel with its log-sum-exp, merged (``merge_segments``): the attention over the whole context; the
    int8 kernel's log-sum-exp is that of its pages dequantised. (Whole engines with segments, on both
    backends: test_prefix_segments.py.)"""
    from apt_serve_ray.attention.backend import merge_segments
    from apt_serve_ray.cache.quant import quantize

    g = torch.Generator().manual_seed(7)
    heads, kvh, dim, bs, num_pages = 8, 2, 32, 16, 80
    kv = torch.randn(num_pages, bs, 2, kvh, dim, generator=g).to(dtype)
    q = torch.randn(len(LENGTHS), heads, dim, generator=g).to(dtype)
    prefix = [48, 16, 32, 64, 16, 96, 32]  # whole pages
    own = [max(1, n - p) for n, p in zip(LENGTHS, prefix)]
    t1, t2 = _table(prefix, bs, num_pages, g), _table(own, bs, num_pages, g)
    l1, l2 = torch.tensor(prefix, dtype=torch.int32), torch.tensor(own, dtype=torch.int32)
    o1, lse1 = ca.kv_decode_lse(q, kv, t1, l1, dim**-0.5, part_tokens)
    o2, lse2 = ca.kv_decode_lse(q, kv, t2, l2, dim**-0.5, part_tokens)
    whole = torch.cat([t1, t2], 1)  # the request's pages: the prefix's, then its own
    for i, p in enumerate(prefix):
        whole[i, : p // bs + t2.shape[1]] = torch.cat([t1[i, : p // bs], t2[i]])
    ref = ca.kv_decode_reference(q.float(), kv.float(), whole, l1 + l2, dim**-0.5)
    assert (merge_segments(o1, lse1, o2, lse2).float() - ref).abs().max() < _tolerance(dtype)
    # The int8 kernel's log-sum-exp: its pages dequantised are what it attends over.
    data, scales = quantize(kv.float().view(num_pages, bs, 2, kvh, dim), dim)
    o8, lse8 = ca.kv_int8_decode_lse(q, data, scales.view(num_pages, bs, 2, kvh).contiguous(), t2, l2, dim**-0.5,
                                     part_tokens)
    deq = (data.float() * scales.view(num_pages, bs, 2, kvh, 1)).to(dtype)
    _, lse_deq = ca.kv_decode_lse(q, deq, t2, l2, dim**-0.5, part_tokens)
    assert (lse8 - lse_deq).abs().max() < 1e-3 * (1 if dtype == torch.float32 else 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [False, True], ids=["learned-positions", "rope"])
@pytest.mark.parametrize("heads,kv_heads,dim,hid", [(4, 4, 16, 64), (4, 2, 32, 128), (12, 12, 64, 768), (3, 3, 10, 30)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_hidden_decode_matches_reference(dtype, rope, heads, kv_heads, dim, hid, bias, threads):
    g = torch.Generator().manual_seed(hid + heads)
    tpp, num_pages = 8, 80
    # A page is wider than the hidden view (GQA: hidden pages have an unused tail): page stride free.
    pool = torch.randn(num_pages, 2 * tpp * hid, generator=g).to(dtype)
    hidden = pool[:, : tpp * hid].view(num_pages, tpp, hid)
    lens = [1, 7, 8, 9, 33, 150]
    table, ctx = _table(lens, tpp, num_pages, g), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    w = (torch.randn(2 * kv_heads * dim, hid, generator=g) / hid**0.5).to(dtype)
    b = (torch.randn(2 * kv_heads * dim, generator=g) * 0.1).to(dtype) if bias else None
    cos = sin = None
    if rope:
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        emb = torch.cat([torch.arange(256).float()[:, None] * inv[None, :]] * 2, dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    ref = hidden_reference(q.float(), hidden.float(), table, ctx, w.float(), f(b), f(cos), f(sin), kv_heads, dim**-0.5)
    for part in (0, 16):
        if rope:
            out = ca.hidden_decode_projected(q, hidden, table, ctx, w.t(), b, cos, sin, kv_heads, dim**-0.5, part)
        else:
            out = ca.hidden_decode_absorbed(q, hidden, table, ctx, w, b, kv_heads, dim**-0.5, part)
        assert out.dtype == dtype and out.shape == q.shape
        assert (out.float() - ref).abs().max() < 2 * _tolerance(dtype), part


def _paged_prefill_case(dtype, n, start, heads, kv_heads, dim, seed):
    """A chunk of ``n`` queries at ``start`` over random pages in a random order: (kv [P, BS, 2, KVH, D],
    block table, q, the context's keys and values [ctx, 2, KVH, D] in float32, SDPA's answer)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    block_size, num_pages = 16, 40
    kv = torch.randn(num_pages, block_size, 2, kv_heads, dim, generator=g).to(dtype)
    ctx = start + n
    table = torch.randperm(num_pages, generator=g)[: -(-ctx // block_size)].to(torch.int32)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    pos = torch.arange(ctx)
    keys = kv[table.long()[pos // block_size], pos % block_size].float()
    mask = pos[None, :] <= torch.arange(start, ctx)[:, None]
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    ref = F.scaled_dot_product_attention(t(q.float()), t(keys[:, 0]), t(keys[:, 1]), attn_mask=mask,
                                         scale=dim**-0.5, enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    return kv, table, q, keys, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,start", [(1, 0), (5, 0), (37, 0), (64, 0), (33, 100), (3, 47), (70, 31), (41, 290)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 32), (2, 1, 128)])
def test_prefill_attention_matches_reference(dtype, n, start, heads, kv_heads, dim, threads):
    if not ca.prefill_supported(dim, dtype):
        pytest.skip("no AVX-512 prefill kernel in this build (the engine uses SDPA)")
    kv, table, q, keys, ref = _paged_prefill_case(dtype, n, start, heads, kv_heads, dim, seed=n * 7 + start)
    ctx = start + n
    out = ca.prefill_attention(q, kv[:, :, 0], kv[:, :, 1], table, start, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max() < _tolerance(dtype)
    contiguous = ca.prefill_attention(q, keys[:, 0, None].to(dtype), keys[:, 1, None].to(dtype),
                                      torch.arange(ctx, dtype=torch.int32), start, dim**-0.5)
    assert torch.equal(contiguous, out)  # the same keys read from pages or from one tensor


def test_kernels_reject_bad_layouts_with_clear_errors():
    q = torch.randn(2, 4, 16)
    kv = torch.randn(10, 16, 2, 4, 16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        ca.kv_decode(q, kv, table.long(), lens, 0.25)
    with pytest.raises(RuntimeError, match="ctx_lens"):
        ca.kv_decode(q, kv, table, torch.tensor([0, 5], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ca.kv_decode(q.to(torch.bfloat16), kv, table, lens, 0.25)
    with pytest.raises(RuntimeError, match="kv"):
        ca.kv_decode(q, kv.transpose(1, 3), table, lens, 0.25)


def test_backend_registry_names_the_valid_choices():
    cpu = torch.device("cpu")
    assert make_backend("torch", cpu).name == "torch"
    assert make_backend("auto", cpu).name == "cpu"
    assert make_backend("cpu", cpu, fused_hidden=False).fused_hidden is False
    with pytest.raises(ValueError, match=r"attention_backend: unknown backend 'flash'.*'torch'"):
        make_backend("flash", cpu)
    with pytest.raises(ValueError, match="CUDA"):
        make_backend("triton", cpu)


def test_auto_falls_back_to_the_reference_when_the_kernels_cannot_build(monkeypatch):
    monkeypatch.setattr(ca, "is_available", lambda: False)
    assert type(make_backend("auto", torch.device("cpu"))) is AttentionBackend


# Whole engines ------------------------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,start", [(1, 0), (37, 0), (33, 100), (3, 47), (70, 31)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 32)])
def test_sdpa_prefill_over_gathered_pages_matches_reference(dtype, n, start, heads, kv_heads, dim):
    # The other prefill path of the CPU backend: pages gathered into one tile, torch's fused attention.
    from apt_serve_ray.attention.cpu_backend import gather_kv_pages, sdpa_prefill

    kv, table, q, keys, ref = _paged_prefill_case(dtype, n, start, heads, kv_heads, dim, seed=n * 5 + start)
    k, v = gather_kv_pages(kv, table, start + n)
    assert torch.equal(k.float(), keys[:, 0]) and torch.equal(v.float(), keys[:, 1])
    out = sdpa_prefill(q, k, v, start, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max() < _tolerance(dtype)


@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_engine_gives_the_reference_answer_on_either_prefill_path(monkeypatch, checkpoint, path):
    # Which path runs is timed per CPU (``prefill_path``); both must give what the reference gives,
    # chunked prompts (context from pages) included. Without AVX-512 "kernel" falls back to SDPA.
    from apt_serve_ray.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "prefill_path", lambda *a, **k: path)
    path_ = checkpoint("llama-tiny-gqa")
    reference = _generate(path_, "torch")
    _assert_close(reference, _generate(path_, "cpu"), 1e-4)
    with pytest.raises(ValueError, match="prefill: must be one of"):
        cpu_backend.CpuBackend(prefill="flash")


def _prompts(n, seed, lo=3, hi=90):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _generate(path, backend, fused=True, dtype="float32", **kw):
    llm = LLM(path, dtype=dtype, num_pages=300, attention_backend=backend, cache_proj_optimize=fused,
              enable_watermarks=False, max_num_batched_tokens=48, calibrate_rho=False, policy="sarathi", **kw)
    outs = llm.generate(_prompts(6, seed=11), PARAMS)
    stats = llm.cache_stats()
    assert stats.num_free_pages == stats.num_pages
    return outs


def _assert_close(a, b, tol):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            common = set(lx) & set(ly)
            assert len(common) >= 8 and max(abs(lx[t] - ly[t]) for t in common) < tol


@pytest.mark.parametrize("shape,ratio,force", [
    ("opt-tiny", 0.0, False), ("opt-tiny", 0.5, False), ("opt-tiny", 1.0, False),
    ("llama-tiny", 0.5, False), ("llama-tiny", 1.0, False), ("llama-tiny-gqa", 0.0, False),
    ("llama-tiny-gqa", 1.0, True),
])
def test_engine_on_cpu_kernels_matches_reference_backend(checkpoint, shape, ratio, force):
    path = checkpoint(shape)
    kw = dict(cache_ratio=ratio, force_hidden=force)
    reference = _generate(path, "torch", **kw)
    for fused in (True, False):
        outs = _generate(path, "cpu", fused, **kw)
        kinds = {o.metrics.cache_kind for o in outs}
        assert kinds == ({"kv"} if ratio == 0 else {"hidden"} if ratio == 1 else {"kv", "hidden"})
        _assert_close(reference, outs, 1e-4)


def test_engine_on_cpu_kernels_in_bfloat16_stays_close(opt_tiny):
    reference = _generate(opt_tiny, "torch", dtype="bfloat16", cache_ratio=0.5)
    outs = _generate(opt_tiny, "cpu", dtype="bfloat16", cache_ratio=0.5)
    for x, y in zip(reference, outs):  # bf16 rounds differently per path: compare the first tokens' logprobs
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        assert max(abs(lx[t] - ly[t]) for t in set(lx) & set(ly)) < 0.1


def test_prompt_logits_hidden_equal_kv_on_cpu_kernels(llama_tiny):
    llm = LLM(llama_tiny, dtype="float32", num_pages=64, cache_ratio=1.0, attention_backend="cpu", policy="sarathi")
    ids = _prompts(1, seed=3, lo=40, hi=41)[0]
    engine = llm.llm_engine
    assert torch.allclose(engine.prompt_logits(ids, CacheKind.KV), engine.prompt_logits(ids, CacheKind.HIDDEN),
                          atol=1e-4, rtol=0)


def test_dtype_auto_follows_the_cpus_native_bf16(monkeypatch, opt_tiny):
    import apt_serve_ray.worker.model_runner as mr

    cpu = torch.device("cpu")
    monkeypatch.setattr(mr, "cpu_has_native_bf16", lambda: True)
    assert mr.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(mr, "cpu_has_native_bf16", lambda: False)
    assert mr.resolve_dtype("auto", cpu) == torch.float32
    assert mr.resolve_dtype("bfloat16", cpu) == torch.bfloat16  # an explicit choice always wins
    assert LLM(opt_tiny, num_pages=16, calibrate_rho=False).llm_engine.runner.dtype == torch.float32


def test_bad_backend_arguments_name_the_field(opt_tiny):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(opt_tiny, num_pages=16, attention_backend="flash")
    with pytest.raises(ValueError, match="cache_proj_optimize"):
        LLM(opt_tiny, num_pages=16, cache_proj_optimize="yes")


def test_cpu_affinity_splits_engine_and_serving_cpus():
    from apt_serve_ray.config import EngineConfig
    from apt_serve_ray.worker.cpu_affinity import engine_cpus, other_cpus

    cpus = [0, 1, 2, 3]
    assert engine_cpus(0, 1, cpus) == [0] and engine_cpus(1, 1, cpus) == [1] and engine_cpus(1, 2, cpus) is None
    assert engine_cpus(0, 2, [0, 1]) is None  # would leave nothing for the rest: no pinning
    assert other_cpus(2, 1, cpus) == [2, 3] and other_cpus(1, 4, cpus) is None
    assert EngineConfig(cpu_affinity=[1]).cpu_affinity == (1,)
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity=[-1])


def test_async_engine_loop_thread_runs_on_its_cpus(opt_tiny):
    import asyncio
    import os

    from apt_serve_ray import AsyncLLMEngine, EngineConfig

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = sorted(os.sched_getaffinity(0))[-1]
    engine = AsyncLLMEngine(EngineConfig(model=opt_tiny, engine_process=False, dtype="float32", num_pages=32, cpu_affinity=(cpu,)))
    engine.start()
    try:
        async def run():
            return [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))]

        assert asyncio.run(run())[-1].finished
        assert os.sched_getaffinity(engine.loop_thread_id) == {cpu}
        assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1  # the caller is untouched
    finally:
        engine.shutdown()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and two CPUs")
def test_rays_processes_on_the_node_are_moved_off_the_engine_cpus():
    """A process whose command line marks it as one of Ray's (here a stand-in started through a shell,
    so it is not our child) is pinned to the CPUs given; our own children and the skipped are not."""
    import subprocess
    import sys
    import time

    from apt_serve_ray.worker.cpu_affinity import keep_ray_processes_off

    cpus = sorted(os.sched_getaffinity(0))
    code = "import time; time.sleep(30)"
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{code}" ray::StandIn & wait'])
    child = subprocess.Popen([sys.executable, "-c", code, "ray::OwnChild"])
    skipped = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{code}" ray::EngineReplica & wait'])
    try:
        def pid_of(mark):  # the python started by the shell (the shell's own command line has the mark too)
            for _ in range(50):
                out = subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout.split()
                for pid in map(int, out):
                    with open(f"/proc/{pid}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid():
                            return pid
                time.sleep(0.1)
            raise AssertionError(f"{mark} did not start")

        stand_in, engine = pid_of("ray::StandIn"), pid_of("ray::EngineReplica")
        assert keep_ray_processes_off([cpus[-1]]) >= 1
        assert os.sched_getaffinity(stand_in) == {cpus[-1]}
        assert os.sched_getaffinity(child.pid) == set(cpus)  # our child: left alone
        assert os.sched_getaffinity(engine) == set(cpus)  # skipped by name
    finally:
        for p in (shell, child, skipped):
            p.kill()
        subprocess.run(["pkill", "-f", "ray::StandIn|ray::EngineReplica"], check=False)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_kv_rows_views_a_fused_projection_and_copies_otherwise(heads, kv_heads):
    """The cache write's K|V rows: a view of the fused QKV output where V sits right after K (no copy),
    the same values stacked where it does not (K rotated into a tensor of its own, rows picked)."""
    from apt_serve_ray.attention.backend import kv_rows

    t, d = 5, 8
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    k, v = k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    expected = torch.stack((k, v), dim=1).flatten(1)
    rows = kv_rows(k, v)
    assert torch.equal(rows, expected) and rows.data_ptr() == k.data_ptr()  # a view: no copy
    rotated = k * 2
    assert torch.equal(kv_rows(rotated, v), torch.stack((rotated, v), dim=1).flatten(1))
    assert kv_rows(rotated, v).data_ptr() != rotated.data_ptr()
    assert torch.equal(kv_rows(v, k), torch.stack((v, k), dim=1).flatten(1))  # V before K: not adjacent

"""The C++ CPU kernels over int8 pages (kv-int8, hidden-int8) against their references: dequantise the
pages with ``cache/quant.py``, then the float32 attention of the exact kinds. Pages live in a real
``CacheStorage`` (byte pages, strided views), ragged lengths cross page boundaries, block tables are
padded with a page whose scales are NaN (read by mistake, it would poison the output). Then whole
engines in each int8 kind on the CPU backend against the reference backend: decode rows through the
kernels, prefill chunks (later ones too) over their context dequantised for the C++ prefill kernel."""

from __future__ import annotations

import pytest
import torch

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.quant import dequantize, quantize
from apt_serve_ray.cache.storage import CacheStorage
from apt_serve_ray.kernels import cpu_attention as ca
from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention_reference as hidden_reference

pytestmark = pytest.mark.skipif(not ca.is_available(), reason="the C++ CPU attention kernels cannot be built here")

NUM_PAGES = 40


def _storage(kv_heads, dim, hid, dtype):
    layout = CacheLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, hidden_size=hid, block_size=16,
                         dtype_bytes=torch.finfo(dtype).bits // 8)
    return CacheStorage(layout, NUM_PAGES, "cpu", dtype)


def _fill(data, scales, group, g):
    """Quantise random rows into the int8 views; the last page is the padding page (NaN scales)."""
    x = torch.randn(data.shape, generator=g) * (1 + torch.rand(data.shape[:-1], generator=g)[..., None])
    q, s = quantize(x, group)
    data.copy_(q)
    scales.copy_(s.view(scales.shape))
    scales[-1] = float("nan")


def _lengths(tpp):
    return [1, tpp - 1, tpp, tpp + 1, 2 * tpp + 5, 5 * tpp - 3]  # inside, at and across page boundaries


def _table(lens, tpp, g):
    """Each request's pages in a random order, then two padding columns (the NaN page)."""
    need = max(-(-n // tpp) for n in lens)
    rows = [torch.randperm(NUM_PAGES - 1, generator=g)[:need] for _ in lens]
    return torch.nn.functional.pad(torch.stack(rows), (0, 2), value=NUM_PAGES - 1).to(torch.int32)


def _tolerance(dtype):
    return 2e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 12, 64), (8, 2, 64), (4, 4, 128), (8, 2, 128), (6, 1, 40)])
@pytest.mark.parametrize("part_tokens", [0, 40])
def test_kv_int8_decode_matches_dequantised_reference(dtype, heads, kv_heads, dim, part_tokens, threads):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    st = _storage(kv_heads, dim, kv_heads * dim, dtype)
    kv, kv_scale = st.kv_int8[0], st.kv_int8_scale[0]
    _fill(kv, kv_scale, dim, g)
    tpp = kv.shape[1]
    lens = _lengths(tpp)
    table, ctx = _table(lens, tpp, g), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    out = ca.kv_int8_decode(q, kv, kv_scale, table, ctx, dim**-0.5, part_tokens)
    ref = ca.kv_int8_decode_reference(q, kv, kv_scale, table[:, :-2], ctx, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max() < _tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [False, True], ids=["learned-positions", "rope"])
@pytest.mark.parametrize("heads,kv_heads,dim,hid", [(12, 12, 64, 768), (4, 2, 32, 128), (4, 4, 128, 512),
                                                    (3, 3, 10, 30)])
def test_hidden_int8_decode_matches_dequantised_reference(dtype, rope, heads, kv_heads, dim, hid, threads):
    g = torch.Generator().manual_seed(hid + heads)
    st = _storage(kv_heads, dim, hid, dtype)
    group = st.layout.quant_group
    hidden, scales = st.hidden_int8[0], st.hidden_int8_scale[0]
    _fill(hidden.view(NUM_PAGES, -1, hid // group, group), scales, group, g)
    tpp = hidden.shape[1]
    lens = _lengths(tpp)
    table, ctx = _table(lens, tpp, g), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    w = (torch.randn(2 * kv_heads * dim, hid, generator=g) / hid**0.5).to(dtype)
    b = (torch.randn(2 * kv_heads * dim, generator=g) * 0.1).to(dtype)
    cos = sin = None
    if rope:
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        emb = torch.cat([torch.arange(6 * tpp).float()[:, None] * inv[None, :]] * 2, dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    x = dequantize(hidden, scales, group)
    ref = hidden_reference(q.float(), x, table[:, :-2], ctx, w.float(), f(b), f(cos), f(sin), kv_heads, dim**-0.5)
    for part in (0, 2 * tpp):
        if rope:
            out = ca.hidden_int8_decode_projected(q, hidden, scales, table, ctx, w.t(), b, cos, sin, kv_heads,
                                                  dim**-0.5, part)
        else:
            out = ca.hidden_int8_decode_absorbed(q, hidden, scales, table, ctx, w, b, kv_heads, dim**-0.5, part)
        assert out.dtype == dtype and out.shape == q.shape
        assert (out.float() - ref).abs().max() < 2 * _tolerance(dtype), part


def test_int8_kernels_reject_bad_scales_with_clear_errors():
    st = _storage(2, 16, 32, torch.float32)
    q = torch.randn(2, 4, 16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    kv, kv_scale = st.kv_int8[0], st.kv_int8_scale[0]
    with pytest.raises(RuntimeError, match="kv_scale"):
        ca.kv_int8_decode(q, kv, kv_scale[:, :, 0], table, lens, 0.25)
    with pytest.raises(RuntimeError, match="kv: expected int8"):
        ca.kv_int8_decode(q, st.kv[0], kv_scale, table, lens, 0.25)
    hidden, scales = st.hidden_int8[0], st.hidden_int8_scale[0]
    w = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match="hidden_scale"):
        ca.hidden_int8_decode_absorbed(q, hidden, scales.double(), table, lens, w, None, 2, 0.25)
    with pytest.raises(RuntimeError, match="hidden_scale"):
        ca.hidden_int8_decode_projected(q, hidden, scales[:, :1], table, lens, w.t(), None, None, None, 2, 0.25)


# Whole engines: the CPU kernels against the reference backend --------------------------------------
def _generate(path, backend, kind, fused=True):
    from apt_serve_ray import LLM, SamplingParams

    llm = LLM(path, dtype="float32", num_pages=200, attention_backend=backend, cache_proj_optimize=fused,
              cache_kinds=(kind,), cache_ratio=1.0, policy="sarathi", enable_watermarks=False,
              max_num_batched_tokens=48, calibrate_rho=False)
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 49000, (int(n),), generator=rng).tolist() for n in (3, 40, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=10))
    assert {o.metrics.cache_kind for o in outs} == {kind}
    return outs


@pytest.mark.parametrize("shape,kind", [("opt-tiny-h32", "kv-int8"), ("opt-tiny-h32", "hidden-int8"),
                                        ("llama-tiny-h32", "kv-int8"), ("llama-tiny-h32", "hidden-int8")])
def test_engine_on_cpu_int8_kernels_matches_reference_backend(checkpoint, shape, kind):
    path = checkpoint(shape)
    reference = _generate(path, "torch", kind)
    for fused in (True, False) if kind == "hidden-int8" else (True,):
        for x, y in zip(reference, _generate(path, "cpu", kind, fused)):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                common = set(lx) & set(ly)
                assert len(common) >= 8 and max(abs(lx[t] - ly[t]) for t in common) < 1e-4

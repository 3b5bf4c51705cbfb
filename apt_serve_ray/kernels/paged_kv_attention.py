"""Paged KV decode attention (Triton, CUDA), with its PyTorch reference beside it.

One program per (request, query head): stream the request's K/V pages through the block table in
blocks of tokens, online softmax, never gathering K/V into a contiguous buffer.

Layouts the wrapper asserts::

    q            [B, H, D]               rotated query of the new token
    kv           [P, BS, 2, KVH, D]      one layer's KV view of the page pool
    block_table  [B, MAXP] int32         pages of each request, padded
    ctx_lens     [B] int32               tokens to attend over (the new one included)

The reference is ``apt_serve_ray.kernels.cpu_attention.kv_decode_reference`` (gather + SDPA).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU runs use the C++ kernels or the PyTorch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


if triton is not None:

    @triton.jit
    def _kv_decode_kernel(
        q_ptr, kv_ptr, table_ptr, len_ptr, out_ptr,
        stride_qb, stride_qh, stride_kp, stride_kt, stride_kc, stride_kh, stride_tb, stride_ob, stride_oh,
        scale, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        length = tl.load(len_ptr + b)
        m_i = float("-inf")
        l_i = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < length
            page = tl.load(table_ptr + b * stride_tb + n // BS, mask=valid, other=0)
            base = kv_ptr + page.to(tl.int64) * stride_kp + (n % BS) * stride_kt + kvh * stride_kh
            mask2 = valid[:, None] & dmask[None, :]
            k = tl.load(base[:, None] + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            v = tl.load(base[:, None] + stride_kc + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)


def paged_kv_decode(q, kv, block_table, ctx_lens, scale: float, block_n: int = 32) -> torch.Tensor:
    """Triton path; same contract as ``kv_decode_reference``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, heads, dim = q.shape
    assert kv.dim() == 5 and kv.shape[2] == 2 and kv.shape[4] == dim, f"kv shape {tuple(kv.shape)}"
    assert heads % kv.shape[3] == 0, "query heads must be a multiple of kv heads"
    assert q.stride(2) == 1 and kv.stride(4) == 1, "innermost dims must be contiguous"
    assert block_table.dtype == torch.int32 and ctx_lens.dtype == torch.int32
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _kv_decode_kernel[(batch, heads)](
        q, kv, block_table, ctx_lens, out,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), block_table.stride(0),
        out.stride(0), out.stride(1),
        scale, BS=kv.shape[1], D=dim, BLOCK_D=triton.next_power_of_2(dim), GROUP=heads // kv.shape[3],
        BLOCK_N=block_n,
    )
    return out

"""Fused hidden-cache decode attention (Triton), with its PyTorch reference beside it.

For each decode request in the batch and each query head, stream the request's stored x through the
K/V projection tile by tile, rotate K (RoPE models) and attend with an online softmax, so K and V of
the context are never written to memory (SPEC section 1).

Layouts the wrapper asserts::

    q            [B, H, D]                  rotated query of the new token
    hidden       [P, TPP, HID]              the hidden view of one layer's page pool (page stride free)
    block_table  [B, MAXP] int32            hidden pages of each request, padded
    ctx_lens     [B] int32                  context length (tokens 0 .. L-1, stored incl. the new one)
    w_kv         [2 * KVH * D, HID]         K rows then V rows of the fused projection
    b_kv         [2 * KVH * D] or None
    cos, sin     [MAX_POS, D] or None       HF rotate-half tables (cos = cat(f, f))

The reference (``hidden_decode_attention_reference``) is the CPU path's math and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: CPU runs use the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def hidden_decode_attention_reference(q, hidden, block_table, ctx_lens, w_kv, b_kv, cos, sin, num_kv_heads, scale):
    batch, heads, dim = q.shape
    tpp = hidden.shape[1]
    length = int(ctx_lens.max())
    pos = torch.arange(length, device=q.device)
    pages = block_table.long()[:, pos // tpp]
    x = hidden[pages, (pos % tpp).expand(batch, length)]  # [B, L, HID]
    kv = F.linear(x, w_kv, b_kv).unflatten(-1, (2, num_kv_heads, dim))
    k, v = kv[..., 0, :, :], kv[..., 1, :, :]  # [B, L, KVH, D]
    if cos is not None:
        c, s = cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)
        k = k * c + torch.cat((-k[..., dim // 2:], k[..., : dim // 2]), dim=-1) * s
    mask = (pos[None, :] < ctx_lens[:, None].long())[:, None, None, :]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale, enable_gqa=heads != num_kv_heads)
    return o.squeeze(2)


if triton is not None:

    @triton.jit
    def _hidden_decode_kernel(
        q_ptr, x_ptr, table_ptr, len_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, out_ptr,
        stride_qb, stride_qh, stride_xp, stride_xt, stride_tb, stride_w, stride_cos, stride_ob, stride_oh,
        scale, TPP: tl.constexpr, HID: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr, KV_ROWS: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, HALF)
        q1 = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
        q2 = tl.load(q_ptr + b * stride_qb + h * stride_qh + HALF + d).to(tl.float32)
        length = tl.load(len_ptr + b)
        k_row = kvh * 2 * HALF  # first K row of this kv head in w_kv; V rows start KV_ROWS later
        m_i = float("-inf")
        l_i = 0.0
        acc1 = tl.zeros([HALF], dtype=tl.float32)
        acc2 = tl.zeros([HALF], dtype=tl.float32)
        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < length
            page = tl.load(table_ptr + b * stride_tb + n // TPP, mask=valid, other=0)
            row = x_ptr + page.to(tl.int64) * stride_xp + (n % TPP) * stride_xt
            k1 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
            k2 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
            v1 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
            v2 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
            for k0 in range(0, HID, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(row[:, None] + kk[None, :], mask=valid[:, None] & (kk[None, :] < HID), other=0.0)
                wmask = kk[:, None] < HID
                wk1 = tl.load(w_ptr + (k_row + d)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
                wk2 = tl.load(w_ptr + (k_row + HALF + d)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
                wv1 = tl.load(w_ptr + (KV_ROWS + k_row + d)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
                wv2 = tl.load(w_ptr + (KV_ROWS + k_row + HALF + d)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
                k1 += tl.dot(x, wk1.to(x.dtype)).to(tl.float32)
                k2 += tl.dot(x, wk2.to(x.dtype)).to(tl.float32)
                v1 += tl.dot(x, wv1.to(x.dtype)).to(tl.float32)
                v2 += tl.dot(x, wv2.to(x.dtype)).to(tl.float32)
            if HAS_BIAS:
                k1 += tl.load(b_ptr + k_row + d)[None, :].to(tl.float32)
                k2 += tl.load(b_ptr + k_row + HALF + d)[None, :].to(tl.float32)
                v1 += tl.load(b_ptr + KV_ROWS + k_row + d)[None, :].to(tl.float32)
                v2 += tl.load(b_ptr + KV_ROWS + k_row + HALF + d)[None, :].to(tl.float32)
            if HAS_ROPE:
                c = tl.load(cos_ptr + n[:, None] * stride_cos + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                s = tl.load(sin_ptr + n[:, None] * stride_cos + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s  # cos/sin halves are equal (cat(f, f))
            scores = (tl.sum(k1 * q1[None, :], axis=1) + tl.sum(k2 * q2[None, :], axis=1)) * scale
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc1 = acc1 * alpha + tl.sum(p[:, None] * v1, axis=0)
            acc2 = acc2 * alpha + tl.sum(p[:, None] * v2, axis=0)
            m_i = m_new
        out = out_ptr + b * stride_ob + h * stride_oh
        tl.store(out + d, (acc1 / l_i).to(out_ptr.dtype.element_ty))
        tl.store(out + HALF + d, (acc2 / l_i).to(out_ptr.dtype.element_ty))


def hidden_decode_attention(q, hidden, block_table, ctx_lens, w_kv, b_kv, cos, sin, num_kv_heads, scale,
                            block_n: int = 16, block_k: int = 32):
    """Triton path; same contract as the reference."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, heads, dim = q.shape
    _, tpp, hid = hidden.shape
    assert dim % 2 == 0 and (dim // 2) & (dim // 2 - 1) == 0 and dim // 2 >= 16, "head_dim/2 must be a power of 2 >= 16"
    assert heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert hidden.stride(2) == 1 and q.stride(2) == 1 and w_kv.stride(1) == 1, "innermost dims must be contiguous"
    assert w_kv.shape == (2 * num_kv_heads * dim, hid), f"w_kv shape {tuple(w_kv.shape)}"
    assert block_table.dtype == torch.int32 and ctx_lens.dtype == torch.int32
    assert (cos is None) == (sin is None)
    out = torch.empty_like(q)
    dummy = q.new_zeros(1)
    _hidden_decode_kernel[(batch, heads)](
        q, hidden, block_table, ctx_lens, w_kv, b_kv if b_kv is not None else dummy,
        cos if cos is not None else dummy, sin if sin is not None else dummy, out,
        q.stride(0), q.stride(1), hidden.stride(0), hidden.stride(1), block_table.stride(0), w_kv.stride(0),
        cos.stride(0) if cos is not None else 0, out.stride(0), out.stride(1),
        scale, TPP=tpp, HID=hid, HALF=dim // 2, GROUP=heads // num_kv_heads, KV_ROWS=num_kv_heads * dim,
        HAS_BIAS=b_kv is not None, HAS_ROPE=cos is not None, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out

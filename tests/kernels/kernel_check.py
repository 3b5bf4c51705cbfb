"""Run by tests/kernels/test_kernels.py in a subprocess with TRITON_INTERPRET=1 set before triton is imported
(or on CUDA, with the default device set there): each Triton kernel against its PyTorch reference."""

import sys

import torch

from apt_serve_ray.kernels.cpu_attention import kv_decode_reference
from apt_serve_ray.kernels.hidden_attention import hidden_decode_attention, hidden_decode_attention_reference
from apt_serve_ray.kernels.paged_kv_attention import paged_kv_decode


def hidden_case(heads, kv_heads, rope, bias, seed):
    g = torch.Generator(device=torch.get_default_device()).manual_seed(seed)  # on CUDA: a CUDA generator
    dim, hid, tpp, pages = 32, 64, 8, 24
    lens = torch.tensor([5, 17, 33], dtype=torch.int32)
    batch = len(lens)
    pool = torch.randn(pages, 2 * tpp * hid, generator=g)  # page stride larger than the hidden view
    hidden = pool[:, : tpp * hid].view(pages, tpp, hid)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    table = perm[: batch * 5].view(batch, 5).contiguous()
    q = torch.randn(batch, heads, dim, generator=g)
    w = torch.randn(2 * kv_heads * dim, hid, generator=g) * 0.1
    b = torch.randn(2 * kv_heads * dim, generator=g) * 0.1 if bias else None
    cos = sin = None
    if rope:
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        f = torch.arange(64).float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    args = (q, hidden, table, lens, w, b, cos, sin, kv_heads, dim**-0.5)
    err = (hidden_decode_attention(*args) - hidden_decode_attention_reference(*args)).abs().max().item()
    print(f"hidden heads={heads} kv={kv_heads} rope={rope} bias={bias}: max err {err:.2e}")
    return err


def kv_case(heads, kv_heads, dim, seed):
    g = torch.Generator(device=torch.get_default_device()).manual_seed(seed)  # on CUDA: a CUDA generator
    block_size, pages = 16, 20
    lens = torch.tensor([1, 16, 17, 45], dtype=torch.int32)
    kv = torch.randn(pages, block_size, 2, kv_heads, dim, generator=g)
    table = torch.randperm(pages, generator=g)[: len(lens) * 3].view(len(lens), 3).to(torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g)
    err = (paged_kv_decode(q, kv, table, lens, dim**-0.5) - kv_decode_reference(q, kv, table, lens, dim**-0.5))
    err = err.abs().max().item()
    print(f"paged kv heads={heads} kv={kv_heads} dim={dim}: max err {err:.2e}")
    return err


errors = [hidden_case(4, 4, False, True, 0), hidden_case(4, 2, True, False, 1), hidden_case(2, 2, True, True, 2),
          kv_case(4, 4, 32, 3), kv_case(4, 2, 16, 4), kv_case(3, 1, 24, 5)]
sys.exit(0 if max(errors) < 1e-4 else 1)

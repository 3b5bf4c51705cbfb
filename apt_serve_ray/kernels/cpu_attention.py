"""CPU decode attention that reads cache pages where they sit (C++/OpenMP), with PyTorch references.

The extension (``csrc/``: decode in ``cpu_attention.cpp``, ``cpu_hidden.cpp`` and ``cpu_kv_int8.cpp`` on
the skeleton of ``flash_decode.h``, prefill in ``cpu_prefill.cpp``, SIMD in ``simd.h``, work shared out
between threads by ``work_queue.h``, the threads bound to CPUs by ``cpu_threads.cpp``) is compiled on first
use with ``torch.utils.cpp_extension`` (g++ and ninja; ``scripts/setup.sh`` builds it ahead of time) for this
CPU (``-march=native``): the build directory is keyed by the source, the torch version and the CPU's feature
flags, so a machine with another CPU builds its own copy. ``load()`` raises ``RuntimeError`` saying what is
missing when it cannot build; ``is_available()`` only answers.

Layouts the wrappers assert (B requests, H query heads, KVH kv heads, D head dim)::

    q            [B, H, D]              rotated query of each request's new token, contiguous
    kv           [P, BS, 2, KVH, D]     one layer's KV view of the page pool
    hidden       [P, TPP, HID]          one layer's hidden view (page stride free, tokens contiguous)
    block_table  [B, max_pages] int32   each request's pages in order, padded with any page id
    ctx_lens     [B] int32              tokens to attend over (stored, including the new one)
    kv_int8      [P, T, 2, KVH, D] int8 + kv_scale [P, T, 2, KVH] float32 (storage.kv_int8[l] and _scale)
    hidden_int8  [P, T, HID] int8 + hidden_scale [P, T, HID // group] float32

Int8 pages (``cache/quant.py``: x ~= q * s) are read in place too: kv-int8 rows are widened to float32
in registers (score = s_k * (q . k8), acc += p * s_v * v8); a hidden-int8 page is dequantised once,
into a thread-local tile of the model's dtype, then attended as a hidden page. These paths use only
``simd.h``'s vectors, so they run on AVX-512, AVX2 (and scalar) builds alike.

Hidden decode comes in two forms. Without RoPE (OPT) the projection is absorbed into the query:
``q.(W_k x + b_k) = (W_k^T q).x + q.b_k``; the constant drops out of the softmax, so the kernel scores
``qk = scale * W_k^T q`` against the stored x and sums ``p x``; ``W_v`` and ``b_v`` are applied once
to that sum. It costs ``2 * H * HID`` multiply-adds per context token per layer instead of the
``2 * HID * 2 * KVH * D`` of projecting K and V, and never forms them. With RoPE (Llama) K depends on
the position, so each page's K|V are projected in a thread-local tile (one small GEMM), K rotated at
the tokens' positions, and attended at once: K/V never reach memory beyond that tile.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apt_serve_ray.cache.quant import dequantize
from apt_serve_ray.worker.cpu_info import cpu_name, cpuinfo_field

logger = logging.getLogger("apt_serve_ray")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_attention.cpp", "cpu_hidden.cpp", "cpu_prefill.cpp", "cpu_kv_int8.cpp",
                                       "cpu_woq.cpp", "cpu_threads.cpp", "cpu_panel.cpp")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-std=c++17"]


def _build_dir() -> tuple[str, Path]:
    key = hashlib.sha256()
    for source in sorted(_CSRC.iterdir()):  # sources and headers
        key.update(source.name.encode())
        key.update(source.read_bytes())
    key.update(" ".join(_FLAGS).encode())
    key.update(torch.__version__.encode())
    key.update((cpuinfo_field("flags") or cpu_name()).encode())
    # Each checkout its own build: torch writes the sources' paths into build.ninja, so two checkouts
    # sharing one directory rebuilt it in turn (minutes each), each under the other's lock.
    key.update(str(_SOURCES[0].parent.resolve()).encode())
    name = f"apt_cpu_attention_{key.hexdigest()[:12]}"
    root = Path(os.environ.get("APT_SERVE_EXTENSIONS_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "apt-serve-ray" / "extensions")
    return name, root / name


@functools.cache
def load():
    """Build (first call; later calls and processes reuse the build) and load the extension, which
    registers ``torch.ops.apt_serve.{kv_decode, hidden_absorbed, hidden_projected}``."""
    if os.environ.get("APT_SERVE_CPU_KERNELS", "1") == "0":
        raise RuntimeError("CPU attention kernels disabled by APT_SERVE_CPU_KERNELS=0")
    # torch finds ninja on PATH; a venv's bin (where pip puts ninja) is not on it unless activated.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    missing = [tool for tool in ("ninja", os.environ.get("CXX", "c++")) if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"cannot build the CPU attention kernels: {', '.join(missing)} not found "
                           "(install g++ and `pip install ninja`, or run scripts/setup.sh)")
    from torch.utils import cpp_extension

    name, directory = _build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory / "lock")
    try:
        return cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                                  extra_ldflags=["-fopenmp"],
                                  build_directory=str(directory), verbose=False)
    except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError / OSError
        raise RuntimeError(f"cannot build the CPU attention kernels in {directory}: {exc}") from exc


STALE_LOCK_S = 1200.0  # a build takes 1-3 minutes here; a lock this old was left by a killed build


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock is a file that a killed build leaves behind, and every later process then
    waits for it forever (an engine start that never ends). One older than ``STALE_LOCK_S`` goes."""
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale build lock %s (%.0f s old: a build was killed)", lock, age)
        lock.unlink(missing_ok=True)


def is_available() -> bool:
    try:
        load()
        return True
    except RuntimeError as exc:
        logger.warning("CPU attention kernels unavailable (%s): using the PyTorch path", exc)
        return False


# Wrappers ----------------------------------------------------------------------------------------
def kv_decode(q, kv, block_table, ctx_lens, scale: float, part_tokens: int = 0) -> torch.Tensor:
    """[B, H, D] attention of each request's query over its KV pages."""
    load()
    return torch.ops.apt_serve.kv_decode(q, kv, block_table, ctx_lens, float(scale), int(part_tokens))


def kv_decode_lse(q, kv, block_table, ctx_lens, scale: float, part_tokens: int = 0):
    """``kv_decode`` and each head's log-sum-exp of the scaled scores (float32 [B, H]): attention over
    one segment of a context, to be merged with another's (``merge_segments``)."""
    load()
    return torch.ops.apt_serve.kv_decode_lse(q, kv, block_table, ctx_lens, float(scale), int(part_tokens))


def kv_int8_decode_lse(q, kv, kv_scale, block_table, ctx_lens, scale: float, part_tokens: int = 0):
    """``kv_int8_decode`` and each head's log-sum-exp, as ``kv_decode_lse``."""
    load()
    return torch.ops.apt_serve.kv_int8_decode_lse(q, kv, kv_scale, block_table, ctx_lens, float(scale),
                                                  int(part_tokens))


def absorb_query(q: torch.Tensor, w_k: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """qk [B, H, HID] float32 = scale * W_k(head)^T q(head), with W_k [KVH * D, HID]."""
    batch, heads, dim = q.shape
    group = heads // num_kv_heads
    wk = w_k.view(num_kv_heads, dim, -1)  # [KVH, D, HID]
    qg = q.view(batch, num_kv_heads, group, dim).permute(1, 0, 2, 3).reshape(num_kv_heads, batch * group, dim)
    qk = torch.bmm(qg, wk).view(num_kv_heads, batch, group, -1).permute(1, 0, 2, 3)  # [B, KVH, G, HID]
    return qk.reshape(batch, heads, -1).float().mul_(scale).contiguous()


def apply_value(y: torch.Tensor, w_v: torch.Tensor, b_v: torch.Tensor | None, num_kv_heads: int,
                dtype: torch.dtype) -> torch.Tensor:
    """out [B, H, D] = W_v(head) y(head) + b_v(head), with y [B, H, HID] = sum_t p_t x_t."""
    batch, heads, hid = y.shape
    group = heads // num_kv_heads
    wv = w_v.view(num_kv_heads, -1, hid)  # [KVH, D, HID]
    yg = y.to(dtype).view(batch, num_kv_heads, group, hid).permute(1, 0, 2, 3).reshape(num_kv_heads, batch * group, hid)
    out = torch.bmm(yg, wv.transpose(1, 2)).view(num_kv_heads, batch, group, -1).permute(1, 0, 2, 3)
    out = out.reshape(batch, heads, -1)
    if b_v is not None:
        out = out + b_v.view(num_kv_heads, 1, -1).repeat_interleave(group, 0).view(heads, -1)
    return out


def hidden_decode_absorbed(q, hidden, block_table, ctx_lens, w_kv, b_kv, num_kv_heads: int, scale: float,
                           part_tokens: int = 0) -> torch.Tensor:
    """Hidden-page decode for models without RoPE; same contract as the fused reference below."""
    kv_dim = w_kv.shape[0] // 2
    qk = absorb_query(q, w_kv[:kv_dim], num_kv_heads, scale)
    load()
    y = torch.ops.apt_serve.hidden_absorbed(qk, hidden, block_table, ctx_lens, int(part_tokens))
    return apply_value(y, w_kv[kv_dim:], None if b_kv is None else b_kv[kv_dim:], num_kv_heads, q.dtype)


def hidden_decode_projected(q, hidden, block_table, ctx_lens, w_kv_t, b_kv, cos, sin, num_kv_heads: int,
                            scale: float, part_tokens: int = 0) -> torch.Tensor:
    """Hidden-page decode projecting K|V page by page (RoPE models). ``w_kv_t`` is ``w_kv.t()`` (a view)."""
    load()
    return torch.ops.apt_serve.hidden_projected(q, hidden, block_table, ctx_lens, w_kv_t, b_kv, cos, sin,
                                                int(num_kv_heads), float(scale), int(part_tokens))


def kv_int8_decode(q, kv, kv_scale, block_table, ctx_lens, scale: float, part_tokens: int = 0) -> torch.Tensor:
    """[B, H, D] attention of each request's query over its kv-int8 pages (``q``'s dtype out)."""
    load()
    return torch.ops.apt_serve.kv_int8_decode(q, kv, kv_scale, block_table, ctx_lens, float(scale), int(part_tokens))


def hidden_int8_decode_absorbed(q, hidden, hidden_scale, block_table, ctx_lens, w_kv, b_kv, num_kv_heads: int,
                                scale: float, part_tokens: int = 0) -> torch.Tensor:
    """``hidden_decode_absorbed`` over hidden-int8 pages."""
    kv_dim = w_kv.shape[0] // 2
    qk = absorb_query(q, w_kv[:kv_dim], num_kv_heads, scale)
    load()
    # The page is dequantised to the model's dtype, as the reference does (bf16: the bf16 kernel's speed).
    y = torch.ops.apt_serve.hidden_int8_absorbed(qk, hidden, hidden_scale, block_table, ctx_lens,
                                                 q.dtype == torch.bfloat16, int(part_tokens))
    return apply_value(y, w_kv[kv_dim:], None if b_kv is None else b_kv[kv_dim:], num_kv_heads, q.dtype)


def hidden_int8_decode_projected(q, hidden, hidden_scale, block_table, ctx_lens, w_kv_t, b_kv, cos, sin,
                                 num_kv_heads: int, scale: float, part_tokens: int = 0) -> torch.Tensor:
    """``hidden_decode_projected`` over hidden-int8 pages (each page dequantised to the model's dtype)."""
    load()
    return torch.ops.apt_serve.hidden_int8_projected(q, hidden, hidden_scale, block_table, ctx_lens, w_kv_t, b_kv,
                                                     cos, sin, int(num_kv_heads), float(scale), int(part_tokens))


def bind_threads(cpus) -> list[int]:
    """Bind ATen's intra-op threads one to a CPU each: thread i (the caller is thread 0) to ``cpus[i % len]``
    (``csrc/cpu_threads.cpp``); their native ids in that order (-1: not bound). Linux only."""
    load()
    return list(torch.ops.apt_serve.bind_threads([int(c) for c in cpus]))


def prefill_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``prefill_attention`` takes this head size and dtype (AVX-512 builds only)."""
    load()
    return dtype in (torch.float32, torch.bfloat16) and torch.ops.apt_serve.prefill_supported(int(head_dim))


def prefill_attention(q, k_pages, v_pages, block_table, start_pos: int, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk (query i at position ``start_pos + i``) over the keys
    ``0 .. start_pos + i`` in the request's pages. ``k_pages``/``v_pages``: ``[P, BS, KVH, D]`` views
    (``kv[:, :, 0]`` / ``kv[:, :, 1]`` of a layer's KV view, or ``k[:, None]`` for contiguous K)."""
    load()
    return torch.ops.apt_serve.prefill_attention(q.contiguous(), k_pages, v_pages, block_table, int(start_pos),
                                                 float(scale))


# References --------------------------------------------------------------------------------------
def kv_decode_reference(q, kv, block_table, ctx_lens, scale: float) -> torch.Tensor:
    """Gather each request's K/V into a padded batch and run SDPA with a padding mask."""
    batch, heads, dim = q.shape
    bs, kvh = kv.shape[1], kv.shape[3]
    length = int(ctx_lens.max())
    pos = torch.arange(length)
    pages = block_table.long()[:, pos // bs]
    gathered = kv[pages, (pos % bs).expand(batch, length)]  # [B, L, 2, KVH, D]
    k, v = gathered[:, :, 0].transpose(1, 2), gathered[:, :, 1].transpose(1, 2)
    mask = (pos[None, :] < ctx_lens[:, None].long())[:, None, None, :]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kvh)
    return o.squeeze(2)


def kv_int8_decode_reference(q, kv, kv_scale, block_table, ctx_lens, scale: float) -> torch.Tensor:
    """Dequantise every page (float32), then ``kv_decode_reference``."""
    return kv_decode_reference(q.float(), dequantize(kv, kv_scale.unsqueeze(-1), kv.shape[-1]), block_table, ctx_lens,
                               scale)


if __name__ == "__main__":  # `python -m apt_serve_ray.kernels.cpu_attention`: build now (set-up scripts)
    logging.basicConfig(level=logging.INFO)
    module = load()
    print(f"CPU attention kernels ready: {module.__file__}")

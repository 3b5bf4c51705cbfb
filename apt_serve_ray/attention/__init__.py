"""Attention over the paged hybrid cache: one interface, a PyTorch reference, a fast path per device.

    backend = make_backend("auto", device, fused_hidden=True)
    out = backend.forward(layer, q, k, v, x, proj, meta, scale)

``torch``: the reference (gather pages, then attend); ``cpu``: C++ kernels that read pages in place;
``triton``: the CUDA kernels. ``auto`` picks ``cpu`` on CPU (``torch`` if the extension cannot be
built, with a warning) and ``triton`` on CUDA (``torch`` without triton).
"""

from __future__ import annotations

import logging
import os

import torch

from apt_serve_ray.attention.backend import AttentionBackend
from apt_serve_ray.attention.metadata import AttentionMetadata, DecodeGroup, KVProjection, PrefillChunk, SlotWrite
from apt_serve_ray.config import ATTENTION_BACKENDS

logger = logging.getLogger("apt_serve_ray")

BACKEND_NAMES = ATTENTION_BACKENDS


def make_backend(name: str, device: torch.device, fused_hidden: bool = True) -> AttentionBackend:
    """The backend ``name`` for ``device``; ValueError naming the field when it cannot run there."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: unknown backend {name!r}; valid names: {list(BACKEND_NAMES)}")
    if name == "auto":
        return _auto(device, fused_hidden)
    if name == "torch":
        return AttentionBackend(fused_hidden)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend: 'cpu' runs on the CPU only, the engine's device is {device.type!r}")
        from apt_serve_ray.attention.cpu_backend import CpuBackend

        try:
            return CpuBackend(fused_hidden)
        except RuntimeError as exc:
            raise ValueError(f"attention_backend: 'cpu' is unavailable: {exc}") from exc
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
    try:
        from apt_serve_ray.attention.triton_backend import TritonBackend

        return TritonBackend(fused_hidden)
    except ImportError as exc:
        raise ValueError(f"attention_backend: 'triton' is unavailable: {exc}") from exc


def _auto(device: torch.device, fused_hidden: bool) -> AttentionBackend:
    if device.type == "cpu":
        from apt_serve_ray.attention.cpu_backend import CpuBackend
        from apt_serve_ray.kernels import cpu_attention

        if cpu_attention.is_available():
            return CpuBackend(fused_hidden)
        return AttentionBackend(fused_hidden)
    if device.type == "cuda":
        try:
            from apt_serve_ray.attention.triton_backend import TritonBackend

            return TritonBackend(fused_hidden)
        except ImportError:
            logger.warning("triton is not installed: attention falls back to the PyTorch path on CUDA")
    return AttentionBackend(fused_hidden)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "DecodeGroup", "KVProjection",
           "PrefillChunk", "SlotWrite", "make_backend"]

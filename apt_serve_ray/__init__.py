"""apt-serve-ray: an LLM engine with a hybrid KV / hidden-state cache and an SLO-aware scheduler.

This package never imports ray; the Ray Serve deployments live in ``deployments/``. Names are
imported lazily, so a process that needs only a light part (the watermark rule, sampling
parameters) does not load torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "apt_serve_ray.engine.llm",
    "HybridCacheLLM": "apt_serve_ray.engine.llm",
    "SamplingParams": "apt_serve_ray.sampling.params",
    "RequestOutputKind": "apt_serve_ray.sampling.params",
    "RequestOutput": "apt_serve_ray.engine.outputs",
    "CompletionOutput": "apt_serve_ray.engine.outputs",
    "EngineConfig": "apt_serve_ray.config",
    "LLMEngine": "apt_serve_ray.engine.llm_engine",
    "AsyncLLMEngine": "apt_serve_ray.engine.async_engine",
    "CacheTracker": "apt_serve_ray.observability.tracker",
    "AdaptiveScheduler": "apt_serve_ray.scheduler.policies.apt",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'apt_serve_ray' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

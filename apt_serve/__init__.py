"""``apt_serve``: the names the project's first sketches used, over ``apt_serve_ray``.

    from apt_serve import HybridCacheLLM, SamplingParams
    from apt_serve.monitor import CacheTracker
    from apt_serve.predictor import TrafficPredictor

Every name is ``apt_serve_ray``'s own object (the same class, not a copy); new code should import
from ``apt_serve_ray``.
"""

from __future__ import annotations

import apt_serve_ray

__all__ = list(apt_serve_ray.__all__)


def __getattr__(name: str):
    if name in apt_serve_ray.__all__:
        return getattr(apt_serve_ray, name)
    raise AttributeError(f"module 'apt_serve' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

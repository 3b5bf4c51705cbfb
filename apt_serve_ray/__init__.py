"""apt-serve-ray: an LLM engine with a hybrid KV / hidden-state cache and an SLO-aware scheduler.

This package never imports ray; the Ray Serve deployments live in ``deployments/``.
"""

from apt_serve_ray.async_engine import AsyncLLMEngine
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.engine import LLMEngine
from apt_serve_ray.llm import LLM, HybridCacheLLM
from apt_serve_ray.observability.tracker import CacheTracker
from apt_serve_ray.outputs import CompletionOutput, RequestOutput
from apt_serve_ray.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "HybridCacheLLM", "SamplingParams", "RequestOutput", "CompletionOutput",
    "EngineConfig", "LLMEngine", "AsyncLLMEngine", "CacheTracker",
]

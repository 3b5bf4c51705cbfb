"""Model registry: architecture (transformers ``model_type``) -> our implementation."""

from __future__ import annotations

from apt_serve_ray.models.base import DecoderModel, ModelShape
from apt_serve_ray.models.gemma import GemmaModel
from apt_serve_ray.models.llama import LlamaModel
from apt_serve_ray.models.opt import OPTModel

# transformers ``model_type`` -> our model code. The Llama family tells its members apart by their weights.
MODEL_REGISTRY: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel, "mistral": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel, "phi3": LlamaModel,
    "gemma": GemmaModel, "gemma2": GemmaModel, "gemma3_text": GemmaModel,
    "opt": OPTModel,
}


def model_class(model_type: str) -> type[DecoderModel]:
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"model: unsupported architecture {model_type!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]



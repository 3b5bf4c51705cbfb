"""Our model code over the paged hybrid cache, its loader and random-weight checkpoints.

Names are imported lazily: the loader (``models.loader``: names, paths, tokenizers, the default model)
is light, and importing it must not load the model code and torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"DecoderModel": "base", "ModelShape": "base", "MODEL_REGISTRY": "registry", "model_class": "registry"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"apt_serve_ray.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'apt_serve_ray.models' has no attribute {name!r}")

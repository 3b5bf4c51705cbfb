"""Shared fixtures: random-weight checkpoints (built once per session) and the real default model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _checkpoint_root(tmp_path_factory) -> str:
    root = os.environ.get("APT_TEST_CHECKPOINTS")
    return root if root else str(tmp_path_factory.getbasetemp() / "checkpoints")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint("opt-tiny") -> path of a random-weight HF checkpoint of that shape."""
    from apt_serve_ray.checkpoints import make_random_checkpoint

    root = _checkpoint_root(tmp_path_factory)

    def make(shape: str) -> str:
        return make_random_checkpoint(os.path.join(root, shape), shape)

    return make


@pytest.fixture(scope="session")
def opt_tiny(checkpoint) -> str:
    return checkpoint("opt-tiny")


@pytest.fixture(scope="session")
def llama_tiny(checkpoint) -> str:
    return checkpoint("llama-tiny")


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct, float32), loaded once per session."""
    from apt_serve_ray import LLM

    return LLM("smollm2-135m-instruct", dtype="float32", num_pages=400, max_num_batched_tokens=512)

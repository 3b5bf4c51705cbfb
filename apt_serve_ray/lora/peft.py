"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) from a local folder.

PEFT's update of a linear layer is ``y = W x + (B (A x)) * scaling`` with ``lora_A.weight`` [r, in],
``lora_B.weight`` [out, r] and ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). Keys are the transformers module paths under ``base_model.model.``, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. What PEFT can save beyond that and
we do not serve is refused with a ``ValueError`` naming the field: DoRA, trained biases, modules saved
whole (``modules_to_save``), per-module ranks or alphas, embedding or lm-head adapters.
Nothing is downloaded: ``path`` is a folder on this machine.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from apt_serve_ray.lora.targets import Targets

_PREFIX = "base_model.model."


@dataclass
class Adapter:
    """An adapter laid out for our groups: per (layer, group index), A [parts * rank, in] and
    Bt [parts * rank, out] (B transposed, the scaling folded in; zero where a part is not targeted)."""

    rank: int
    scaling: float
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def _config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"lora_path: {path!r} has no adapter_config.json (a PEFT LoRA adapter folder is expected)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora_path: {file} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are served, got {config.get('peft_type')!r}")
    refused = {"use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D) layouts",
               "lora_bias": "trained LoRA biases", "modules_to_save": "modules saved whole",
               "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas"}
    for field, what in refused.items():
        if config.get(field):
            raise ValueError(f"{field}: {what} are not served (adapter {path!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: adapters that train biases ({config['bias']!r}) are not served (adapter {path!r})")
    return config


def check_folder(path: str) -> None:
    """A ``ValueError`` naming the field unless ``path`` holds a PEFT LoRA adapter we serve (its config
    and a weights file; the weights' shapes are checked where it is loaded, against the model)."""
    _config(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"lora_path: {path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def _state(path: str) -> dict[str, torch.Tensor]:
    st, binary = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path: {path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(path: str, targets: Targets, *, max_rank: int, dtype: torch.dtype) -> Adapter:
    """The adapter in ``path`` laid out for ``targets``, each group's rank blocks ``max_rank`` wide."""
    config = _config(path)
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r: the adapter's rank must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ValueError(f"r: the adapter's rank {r} exceeds max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for key, tensor in _state(path).items():
        name = key.removeprefix(_PREFIX)
        for suffix, which in ((".lora_A.weight", "A"), (".lora_B.weight", "B"),
                              (".lora_A.default.weight", "A"), (".lora_B.default.weight", "B")):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                break
        else:
            raise ValueError(f"lora_path: {key!r} is not a LoRA A/B weight of a linear layer "
                             f"(embedding, lm-head and whole-module weights are not served)")
        where = targets.locate(module)
        if where is None:
            raise ValueError(f"target_modules: {module!r} is not a linear layer adapters can target here")
        pairs.setdefault(where, {})[which] = tensor
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, g, p), ab in sorted(pairs.items()):
        group = targets.groups[g]
        path_name, c0, c1 = group.parts[p]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path: {path_name} of layer {layer} has only lora_{next(iter(ab))}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.shape != (r, group.in_features) or b.shape != (c1 - c0, r):
            raise ValueError(f"lora_path: {path_name} of layer {layer}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)}, expected ({r}, {group.in_features}) / ({c1 - c0}, {r})")
        if (layer, g) not in weights:
            rows = len(group.parts) * max_rank
            weights[layer, g] = (torch.zeros(rows, group.in_features), torch.zeros(rows, group.out_features))
        big_a, big_bt = weights[layer, g]
        big_a[p * max_rank: p * max_rank + r] = a
        big_bt[p * max_rank: p * max_rank + r, c0:c1] = (b * scaling).T
    if not weights:
        raise ValueError(f"lora_path: {path!r} holds no LoRA weights")
    return Adapter(r, scaling, {k: (a.to(dtype), bt.to(dtype)) for k, (a, bt) in weights.items()})

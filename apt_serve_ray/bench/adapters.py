"""Random LoRA adapters written as PEFT folders, for the benchmarks (no adapter is downloaded)."""

from __future__ import annotations

import json
import os

import torch

from apt_serve_ray.lora.targets import lora_targets


def write_random_adapter(folder: str, hf_config, rank: int, seed: int, modules: tuple[str, ...] | None) -> None:
    """A PEFT folder with lora_A / lora_B for ``modules`` (None: every module our targets know), random
    (B not zero)."""
    from safetensors.torch import save_file

    targets = lora_targets(hf_config)
    g = torch.Generator().manual_seed(seed)
    tensors, names = {}, set()
    for i in range(targets.num_layers):
        for group in targets.groups:
            for path, c0, c1 in group.parts:
                if modules is not None and path.rsplit(".", 1)[-1] not in modules:
                    continue
                key = f"base_model.model.{targets.layer_prefix.format(i)}.{path}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, group.in_features, generator=g) / group.in_features ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(c1 - c0, rank, generator=g) * 0.01
                names.add(path.rsplit(".", 1)[-1])
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(names)}, f)

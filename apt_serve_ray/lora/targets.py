"""Where LoRA adapters attach in our model code: per model family, the linear layers (groups) a PEFT
adapter may target, and which columns of a fused layer each PEFT module owns.

Our layers fuse what transformers keeps apart (q/k/v into ``qkv``, Llama's gate/up into ``gate_up``:
``models.base.fuse``, output blocks side by side), so a PEFT module is a column range of a group. An
adapter's low-rank update of a group is held as one pair of matrices: the parts' A matrices stacked
(one rank block each) and their B matrices placed in their parts' columns (block-diagonal), which is
exactly the sum of the per-module updates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """A linear layer of every decoder layer (``attr`` on ``model.layers[i]``) that adapters may target."""

    attr: str
    in_features: int
    out_features: int
    parts: tuple[tuple[str, int, int], ...]  # (PEFT module path under the layer's prefix, first column, end)


@dataclass(frozen=True)
class Targets:
    layer_prefix: str  # PEFT (transformers) module path of decoder layer i: ``layer_prefix.format(i)``
    num_layers: int
    groups: tuple[Group, ...]

    def locate(self, module: str) -> tuple[int, int, int] | None:
        """(layer, group index, part index) of a PEFT module path (``model.layers.3.self_attn.q_proj``),
        None where no group has it."""
        head, sep, rest = self.layer_prefix.partition("{}")
        if not sep or not module.startswith(head):
            return None
        num, dot, name = module[len(head):].partition(".")
        if not num.isdigit() or not dot or not 0 <= int(num) < self.num_layers:
            return None
        tail = rest.lstrip(".")
        if tail:
            if not name.startswith(tail + "."):
                return None
            name = name[len(tail) + 1:]
        for g, group in enumerate(self.groups):
            for p, (path, _, _) in enumerate(group.parts):
                if path == name:
                    return int(num), g, p
        return None


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "opt")


def lora_targets(hf_config) -> Targets:
    """The groups of a model (its transformers config); a ``ValueError`` naming ``lora_modules`` for a
    family LoRA is not served for here."""
    kind = hf_config.model_type
    if kind not in SUPPORTED:
        raise ValueError(f"lora_modules: LoRA adapters are served for {', '.join(SUPPORTED)} models, not {kind!r}")
    n = hf_config.num_hidden_layers
    d = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    if kind == "opt":
        ffn = hf_config.ffn_dim
        return Targets("model.decoder.layers.{}", n, (
            Group("qkv", d, 3 * d, (("self_attn.q_proj", 0, d), ("self_attn.k_proj", d, 2 * d),
                                    ("self_attn.v_proj", 2 * d, 3 * d))),
            Group("out", d, d, (("self_attn.out_proj", 0, d),)),
            Group("fc1", d, ffn, (("fc1", 0, ffn),)),
            Group("fc2", ffn, d, (("fc2", 0, d),)),
        ))
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    q, kv = heads * head_dim, (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inter = hf_config.intermediate_size
    if kind == "phi3":  # fused in the checkpoint too: PEFT targets the fused modules
        qkv_parts = (("self_attn.qkv_proj", 0, q + 2 * kv),)
        gate_up_parts = (("mlp.gate_up_proj", 0, 2 * inter),)
    else:
        qkv_parts = (("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, q + kv), ("self_attn.v_proj", q + kv, q + 2 * kv))
        gate_up_parts = (("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, 2 * inter))
    return Targets("model.layers.{}", n, (
        Group("qkv", d, q + 2 * kv, qkv_parts),
        Group("out", q, d, (("self_attn.o_proj", 0, d),)),
        Group("gate_up", d, 2 * inter, gate_up_parts),
        Group("down", inter, d, (("mlp.down_proj", 0, d),)),
    ))

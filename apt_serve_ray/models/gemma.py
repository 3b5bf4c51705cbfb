"""Gemma, Gemma 2 and Gemma 3 (text) decoders on the paged hybrid cache.

What sets them apart from the Llama family (``llama.py``), each as transformers has it:

- RMSNorm scaled by ``1 + weight``, in float32, then cast (``gemma_rms_norm``);
- embeddings multiplied by ``sqrt(hidden_size)`` (in the model's dtype); tied output embeddings;
- a GeLU-tanh gated MLP (``hidden_activation``);
- Gemma 2 / 3: a norm after attention and after the MLP as well as before each (``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), queries scaled by
  ``query_pre_attn_scalar ** -0.5``, and layers alternating between sliding-window (local) and full
  (global) attention (``layer_types``, ``sliding_window``): a local layer's query sees only the keys
  less than ``sliding_window`` positions behind it. Here that is a mask over the pages the request holds
  (``AttentionBackend._forward_masked``): exact at any length, but the pages behind the window are
  kept (the global layers read them anyway);
- Gemma 2: attention scores and final logits soft-capped (``c * tanh(x / c)``);
- Gemma 3: RMSNorm over each head of q and k before RoPE (Gemma's norm), and rotary tables of their
  own for local and global layers (``rope_parameters`` per layer type).

Which one a checkpoint is comes from its weights (post-feedforward norms, q/k norms) and config.
Gemma 2 and 3 are grouped-query models (their hidden kind is off by the layout's rule); Gemma-7B is
multi-head. The hidden path projects K as the model does (Gemma 3's k norm through ``KVProjection``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_serve_ray.attention import AttentionMetadata, KVProjection
from apt_serve_ray.models.base import DecoderModel, ModelShape, fuse, kv_weight, take, take_optional
from apt_serve_ray.models.linear import make_linear
from apt_serve_ray.models.llama import _ACTIVATIONS
from apt_serve_ray.models.rotary import RotaryEmbedding


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm: float32 statistics, scaled by (1 + weight) in float32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class _Layer:
    def __init__(self, state, prefix, device, dtype, quantization=None, q_rows: int = 0):
        g = lambda n: take(state, prefix + n, device, dtype)  # noqa: E731
        o = lambda n: take_optional(state, prefix + n, device, dtype)  # noqa: E731
        self.input_norm = g("input_layernorm.weight")
        self.post_attn_norm = g("post_attention_layernorm.weight")  # Gemma: the MLP's pre-norm
        self.pre_ffn_norm = o("pre_feedforward_layernorm.weight")  # Gemma 2 / 3
        self.post_ffn_norm = o("post_feedforward_layernorm.weight")
        if (self.pre_ffn_norm is None) != (self.post_ffn_norm is None):
            raise ValueError(f"checkpoint: {prefix} has one of pre/post_feedforward_layernorm but not the other")
        self.w_qkv = fuse(g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight"))
        self.b_qkv = fuse(o("self_attn.q_proj.bias"), o("self_attn.k_proj.bias"), o("self_attn.v_proj.bias"))
        self.q_norm, self.k_norm = o("self_attn.q_norm.weight"), o("self_attn.k_norm.weight")  # Gemma 3
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError(f"checkpoint: {prefix}self_attn has one of q_norm / k_norm but not the other")
        # The hidden path projects with its K/V rows (dequantized where quantized).
        self.qkv = make_linear(self.w_qkv, self.b_qkv, quantization=quantization, keep_weight=True,
                               keep_rows=len(self.w_qkv) - q_rows)
        self.out = make_linear(g("self_attn.o_proj.weight"), o("self_attn.o_proj.bias"), quantization=quantization)
        self.gate_up = make_linear(fuse(g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")), quantization=quantization)
        self.down = make_linear(g("mlp.down_proj.weight"), quantization=quantization)


class GemmaModel(DecoderModel):
    masks_sliding_window = True

    def __init__(self, config, state: dict[str, torch.Tensor], device, dtype, max_model_len: int,
                 quantization: str | None = None) -> None:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab_size=config.vocab_size, max_model_len=max_model_len,
        )
        self.eps = config.rms_norm_eps
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation: unsupported activation {act!r}; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.q_dim, self.kv_dim = heads * head_dim, self.shape.num_kv_heads * head_dim
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.scale = (scalar if scalar else head_dim) ** -0.5
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None) or None
        self.final_softcap = getattr(config, "final_logit_softcapping", None) or None
        self.embed = take(state, "model.embed_tokens.weight", device, dtype)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=device)
        self.layers = [_Layer(state, f"model.layers.{i}.", device, dtype, quantization, self.q_dim)
                       for i in range(self.shape.num_layers)]
        self.norm = take(state, "model.norm.weight", device, dtype)
        lm_head = take_optional(state, "lm_head.weight", device, dtype)
        tied = lm_head is None or getattr(config, "tie_word_embeddings", True)
        self.logits = make_linear(self.embed if tied else lm_head, quantization=None if tied else quantization,
                                  keep_weight=True)
        types = getattr(config, "layer_types", None) or ["full_attention"] * self.shape.num_layers
        window = getattr(config, "sliding_window", None)
        self.windows = [int(window) if t == "sliding_attention" and window else None for t in types]
        params = getattr(config, "rope_parameters", None) or {}
        per_type = set(types) <= set(params)  # Gemma 3: one set of rotary parameters per kind of layer
        rotaries = {t: RotaryEmbedding(config, head_dim, max_model_len, device, dtype, t if per_type else None)
                    for t in set(types)}
        self.rotaries = [rotaries[t] for t in types]
        self.kv_projections = [
            KVProjection(kv_weight(lay, self.q_dim), None if lay.b_qkv is None else lay.b_qkv[self.q_dim:],
                         self.shape.num_kv_heads, head_dim, rot, lay.k_norm, self.eps, gemma_norm=True)
            for lay, rot in zip(self.layers, self.rotaries)
        ]
        if quantization is not None:
            for lay in self.layers:
                lay.w_qkv = None  # quantized in ``qkv``, which keeps the K/V rows dequantized

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        s, eps = self.shape, self.eps
        h = F.embedding(input_ids, self.embed) * self.embed_scale
        n = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = gemma_rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv(x)
            q = qkv[:, :self.q_dim].view(n, s.num_heads, s.head_dim)
            k = qkv[:, self.q_dim:self.q_dim + self.kv_dim].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, self.q_dim + self.kv_dim:].view(n, s.num_kv_heads, s.head_dim)
            if layer.q_norm is not None:
                q, k = gemma_rms_norm(q, layer.q_norm, eps), gemma_rms_norm(k, layer.k_norm, eps)
            rotary = self.rotaries[i]
            q, k = rotary.apply(q, positions), rotary.apply(k, positions)
            a = meta.backend.forward(i, q, k, v, x, self.kv_projections[i], meta, self.scale,
                                     window=self.windows[i], softcap=self.attn_softcap)
            a = layer.out(a.reshape(n, -1))
            if layer.pre_ffn_norm is None:  # Gemma: pre-norms only
                h = h + a
                x = gemma_rms_norm(h, layer.post_attn_norm, eps)
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                h = h + layer.down(self.act(gate) * up)
                continue
            h = h + gemma_rms_norm(a, layer.post_attn_norm, eps)
            x = gemma_rms_norm(h, layer.pre_ffn_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + gemma_rms_norm(layer.down(self.act(gate) * up), layer.post_ffn_norm, eps)
        return gemma_rms_norm(h, self.norm, eps)

    def compute_logits(self, hidden):
        logits = self.logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

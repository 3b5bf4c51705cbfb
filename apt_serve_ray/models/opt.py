"""OPT decoder (the Apt-Serve paper's models: multi-head attention, learned positions, biases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_serve_ray.models.base import DecoderModel, ModelShape, fuse, kv_weight, take, take_optional
from apt_serve_ray.models.linear import make_linear
from apt_serve_ray.attention import AttentionMetadata, KVProjection

_POSITION_OFFSET = 2  # OPT's learned position table is shifted by 2 (a fairseq legacy).


class _Layer:
    def __init__(self, state, prefix, device, dtype, quantization=None, q_rows: int = 0):
        g = lambda n: take(state, prefix + n, device, dtype)  # noqa: E731
        o = lambda n: take_optional(state, prefix + n, device, dtype)  # noqa: E731
        self.attn_norm = (o("self_attn_layer_norm.weight"), o("self_attn_layer_norm.bias"))
        self.mlp_norm = (o("final_layer_norm.weight"), o("final_layer_norm.bias"))
        self.w_qkv = fuse(g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight"))
        self.b_qkv = fuse(o("self_attn.q_proj.bias"), o("self_attn.k_proj.bias"), o("self_attn.v_proj.bias"))
        # The hidden path projects with w_qkv's K/V rows (dequantized where quantized).
        self.qkv = make_linear(self.w_qkv, self.b_qkv, quantization=quantization, keep_weight=True,
                               keep_rows=len(self.w_qkv) - q_rows)
        self.out = make_linear(g("self_attn.out_proj.weight"), o("self_attn.out_proj.bias"), quantization=quantization)
        self.fc1 = make_linear(g("fc1.weight"), o("fc1.bias"), quantization=quantization)
        self.fc2 = make_linear(g("fc2.weight"), o("fc2.bias"), quantization=quantization)


class OPTModel(DecoderModel):
    def __init__(self, config, state: dict[str, torch.Tensor], device, dtype, max_model_len: int,
                 quantization: str | None = None) -> None:
        heads = config.num_attention_heads
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=config.hidden_size // heads,
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
        )
        if config.activation_function != "relu":
            raise ValueError(f"activation_function: only relu OPT models are supported, got {config.activation_function!r}")
        self.pre_norm = config.do_layer_norm_before
        self.dim = config.hidden_size
        self.scale = self.shape.head_dim**-0.5
        p = "model.decoder."
        self.embed = take(state, p + "embed_tokens.weight", device, dtype)
        self.embed_positions = take(state, p + "embed_positions.weight", device, dtype)
        self.project_in = take_optional(state, p + "project_in.weight", device, dtype)
        self.project_out = take_optional(state, p + "project_out.weight", device, dtype)
        self.final_norm = (take_optional(state, p + "final_layer_norm.weight", device, dtype),
                           take_optional(state, p + "final_layer_norm.bias", device, dtype))
        self.layers = [_Layer(state, f"{p}layers.{i}.", device, dtype, quantization, self.dim)
                       for i in range(self.shape.num_layers)]
        lm_head = take_optional(state, "lm_head.weight", device, dtype)
        self.lm_head = self.embed if lm_head is None or getattr(config, "tie_word_embeddings", True) else lm_head
        self.logits = make_linear(self.lm_head, quantization=None if self.lm_head is self.embed else quantization,
                                  keep_weight=True)
        self.kv_projections = [
            KVProjection(kv_weight(lay, self.dim), None if lay.b_qkv is None else lay.b_qkv[self.dim:], heads,
                         self.shape.head_dim)
            for lay in self.layers
        ]
        if quantization is not None:
            for lay in self.layers:
                lay.w_qkv = None  # quantized in ``qkv``, which keeps the K/V rows dequantized

    def _norm(self, x, params):
        weight, bias = params
        return F.layer_norm(x, (self.dim,), weight, bias, 1e-5)

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        s = self.shape
        h = F.embedding(input_ids, self.embed)
        if self.project_in is not None:
            h = F.linear(h, self.project_in)
        h = h + F.embedding(positions + _POSITION_OFFSET, self.embed_positions)
        n = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.attn_norm) if self.pre_norm else h
            qkv = layer.qkv(x).view(n, 3, s.num_heads, s.head_dim)
            q, k, v = qkv.unbind(1)
            a = meta.backend.forward(i, q, k, v, x, self.kv_projections[i], meta, self.scale)
            h = h + layer.out(a.reshape(n, -1))
            if not self.pre_norm:
                h = self._norm(h, layer.attn_norm)
            x = self._norm(h, layer.mlp_norm) if self.pre_norm else h
            h = h + layer.fc2(F.relu_(layer.fc1(x)))
            if not self.pre_norm:
                h = self._norm(h, layer.mlp_norm)
        if self.final_norm[0] is not None and self.pre_norm:
            h = self._norm(h, self.final_norm)
        if self.project_out is not None:
            h = F.linear(h, self.project_out)
        return h

    def compute_logits(self, hidden):
        return self.logits(hidden)

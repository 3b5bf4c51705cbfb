"""Llama-family decoders on the paged hybrid cache: Llama 2/3 and SmolLM2, Mistral, Qwen2 / Qwen2.5
(biases on q/k/v), Qwen3 (RMSNorm over each head of q and k before RoPE) and Phi-3 (fused qkv and
gate-up weights, partial rotary). One pre-norm block with a gated MLP; what differs between the
architectures is read from the checkpoint's weights (a fused projection, a bias, a norm) and config
(activation, rotary share). MHA or grouped-query attention.

Sliding-window attention (Mistral v0.1, Phi-3-mini, Qwen2 with ``use_sliding_window``): a layer whose
``layer_types`` entry is ``sliding_attention`` (every layer where the config names none) lets a query see
only the keys less than ``sliding_window`` positions behind it, as transformers' sliding-window mask does.
Where the window is shorter than ``max_model_len`` those layers take the masked path
(``AttentionBackend._forward_masked``, as Gemma 2's local layers): exact at any length; the pages behind
the window are kept, not freed. Where it is not, full attention is the same thing and the fast kernels
serve every layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_serve_ray.models.base import DecoderModel, ModelShape, fuse, kv_weight, take, take_optional
from apt_serve_ray.models.linear import make_linear
from apt_serve_ray.models.rotary import RotaryEmbedding
from apt_serve_ray.attention import AttentionMetadata, KVProjection

# The gated MLP's activation, by the config's ``hidden_act``.
_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def sliding_window(config) -> int | None:
    """The attention window of a checkpoint whose layers use one (None: full attention everywhere)."""
    return next((w for w in layer_windows(config) if w is not None), None)


def layer_windows(config) -> list[int | None]:
    """Each layer's attention window (None: full attention), as transformers reads the config: every
    layer slides where ``layer_types`` is not given, else those marked ``sliding_attention``."""
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    if not window:
        return [None] * n
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    return [int(window) if t == "sliding_attention" else None for t in types]


class _Layer:
    def __init__(self, state, prefix, device, dtype, quantization=None, q_rows: int = 0):
        g = lambda n: take(state, prefix + n, device, dtype)  # noqa: E731
        o = lambda n: take_optional(state, prefix + n, device, dtype)  # noqa: E731
        self.input_norm = g("input_layernorm.weight")
        self.post_norm = g("post_attention_layernorm.weight")
        if prefix + "self_attn.qkv_proj.weight" in state:  # Phi-3: one fused projection
            self.w_qkv, self.b_qkv = g("self_attn.qkv_proj.weight"), o("self_attn.qkv_proj.bias")
        else:
            self.w_qkv = fuse(g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                              g("self_attn.v_proj.weight"))
            self.b_qkv = fuse(o("self_attn.q_proj.bias"), o("self_attn.k_proj.bias"), o("self_attn.v_proj.bias"))
        self.q_norm, self.k_norm = o("self_attn.q_norm.weight"), o("self_attn.k_norm.weight")  # Qwen3
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError(f"checkpoint: {prefix}self_attn has one of q_norm / k_norm but not the other")
        # The hidden path projects with w_qkv's K/V rows (dequantized where quantized).
        self.qkv = make_linear(self.w_qkv, self.b_qkv, quantization=quantization, keep_weight=True,
                               keep_rows=len(self.w_qkv) - q_rows)
        self.out = make_linear(g("self_attn.o_proj.weight"), o("self_attn.o_proj.bias"), quantization=quantization)
        if prefix + "mlp.gate_up_proj.weight" in state:  # Phi-3
            self.gate_up = make_linear(g("mlp.gate_up_proj.weight"), quantization=quantization)
        else:
            self.gate_up = make_linear(fuse(g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")),
                                       quantization=quantization)
        self.down = make_linear(g("mlp.down_proj.weight"), quantization=quantization)


class LlamaModel(DecoderModel):
    masks_sliding_window = True

    def __init__(self, config, state: dict[str, torch.Tensor], device, dtype, max_model_len: int,
                 quantization: str | None = None) -> None:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
        )
        self.eps = config.rms_norm_eps
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: unsupported activation {act!r}; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.q_dim = heads * head_dim
        self.kv_dim = self.shape.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.embed = take(state, "model.embed_tokens.weight", device, dtype)
        self.layers = [_Layer(state, f"model.layers.{i}.", device, dtype, quantization, self.q_dim)
                       for i in range(self.shape.num_layers)]
        self.norm = take(state, "model.norm.weight", device, dtype)
        lm_head = take_optional(state, "lm_head.weight", device, dtype)
        self.lm_head = self.embed if lm_head is None or getattr(config, "tie_word_embeddings", False) else lm_head
        self.logits = make_linear(self.lm_head, quantization=None if self.lm_head is self.embed else quantization,
                                  keep_weight=True)
        self.rotary = RotaryEmbedding(config, head_dim, max_model_len, device, dtype)
        # A window no shorter than the longest sequence served masks nothing: those layers attend in full.
        self.windows = [w if w is not None and w < max_model_len else None for w in layer_windows(config)]
        self.kv_projections = [
            KVProjection(kv_weight(lay, self.q_dim), None if lay.b_qkv is None else lay.b_qkv[self.q_dim:],
                         self.shape.num_kv_heads, head_dim, self.rotary, lay.k_norm, self.eps)
            for lay in self.layers
        ]
        if quantization is not None:
            for lay in self.layers:
                lay.w_qkv = None  # quantized in ``qkv``, which keeps the K/V rows dequantized

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        s = self.shape
        h = F.embedding(input_ids, self.embed)
        n = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = layer.qkv(x)
            q = qkv[:, : self.q_dim].view(n, s.num_heads, s.head_dim)
            k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, self.q_dim + self.kv_dim :].view(n, s.num_kv_heads, s.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
            q = self.rotary.apply(q, positions)
            k = self.rotary.apply(k, positions)
            a = meta.backend.forward(i, q, k, v, x, self.kv_projections[i], meta, self.scale, window=self.windows[i])
            h = h + layer.out(a.reshape(n, -1))
            x = self._rms_norm(h, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(self.act(gate) * up)
        return self._rms_norm(h, self.norm)

    def compute_logits(self, hidden):
        return self.logits(hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim. Same op order as transformers' LlamaRMSNorm (float32 statistics), so bf16
    matches too."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)

"""What the model runner needs from a model: a forward pass over a flat token batch on the paged
cache, logits for chosen rows, and K/V projection of stored x (hidden-cache decode and upgrades)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apt_serve_ray.attention import AttentionMetadata, KVProjection


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int


class DecoderModel:
    shape: ModelShape
    kv_projections: list[KVProjection]  # per layer: what turns a stored x into K and V
    # Whether its sliding-window layers attend within their window at any length (a mask); if not, the
    # runner caps max_model_len at the window, where full attention is the same thing.
    masks_sliding_window = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids at [T] positions -> [T, hidden] final hidden states."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def project_kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored x [..., n, hidden] -> rotated K and V [..., n, kv_heads, head_dim] of ``layer``."""
        return self.kv_projections[layer](x, positions)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor ``obj`` (a model) holds, found through its attributes, lists and layers: packed,
    quantized or plain, a tensor shared (a tied lm-head's embedding) counted once."""
    seen, total = set(), 0
    stack = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except NotImplementedError:  # oneDNN's packed layout (an opaque tensor): its elements
                key, nbytes = id(item), item.numel() * item.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
        elif depth < 4 and isinstance(item, (list, tuple)):
            stack.extend((o, depth + 1) for o in item)
        elif depth < 4 and (hasattr(item, "__dict__") or hasattr(type(item), "__slots__")):
            names = list(getattr(item, "__dict__", {})) + list(getattr(type(item), "__slots__", ()))
            stack.extend((getattr(item, n, None), depth + 1) for n in names)
    return total


def take(state: dict[str, torch.Tensor], name: str, device, dtype) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"checkpoint: missing weight {name!r}")
    return state.pop(name).to(device=device, dtype=dtype)


def take_optional(state: dict[str, torch.Tensor], name: str, device, dtype) -> torch.Tensor | None:
    return take(state, name, device, dtype) if name in state else None


def kv_weight(layer, start: int) -> torch.Tensor:
    """The K/V rows (``start:``) of a layer's fused q/k/v weight, with which the hidden cache kinds project
    stored x: a view of the full-width weight, or where ``layer.qkv`` is quantized, the rows it keeps
    dequantized (the weights the KV path multiplies by, so both kinds agree)."""
    kept = getattr(layer.qkv, "kept_rows", None)
    return kept if kept is not None else layer.w_qkv[start:]


def fuse(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    """Concatenate projection weights (or biases) along the output dim; None if all are None."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    if len(present) != len(tensors):
        raise ValueError("checkpoint: some of q/k/v have a bias and others do not")
    from apt_serve_ray.models.checkpoint_quant import QuantizedWeight

    if any(isinstance(t, QuantizedWeight) for t in present):
        if not all(isinstance(t, QuantizedWeight) for t in present):
            raise ValueError("checkpoint: fused projections (q/k/v or gate/up) are quantized in part only")
        return QuantizedWeight.cat(present)
    return torch.cat(present, dim=0).contiguous()

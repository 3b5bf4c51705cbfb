"""Write a full-width checkpoint quantized in one of the formats people deploy (GPTQ, AWQ, compressed-tensors
W8A8 and W4A16), with round-to-nearest weights (no calibration data: the formats, not the GPTQ / AWQ search,
are what serving them needs), and optionally the same model dequantized to full width, the reference its
outputs are held to (issue 43).

    python -m apt_serve_ray.models.quantize_checkpoint SRC DST --format gptq [--group-size 128] [--act-order]
        [--reference REF_DIR]

SRC: a local Hugging Face directory (config.json + safetensors), a GGUF file, or a name our loader resolves
(the default model: its GGUF, written out with its config and tokenizer).
The linear layers of the decoder blocks are quantized (embeddings, norms, biases and the lm-head are not, as
GPTQ / AWQ / llm-compressor leave them). The packing of each format: ``checkpoint_quant.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from apt_serve_ray.models.checkpoint_quant import AWQ_ORDER

FORMATS = ("gptq", "awq", "w8a8", "w4a16")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
           "gate_up_proj", "fc1", "fc2")


def is_quantized_layer(name: str, tensor: torch.Tensor) -> bool:
    parts = name.split(".")
    return (tensor.dim() == 2 and name.endswith(".weight") and len(parts) >= 2 and parts[-2] in LINEARS
            and ".layers." in name)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[8R, C] 4-bit values -> int32 [R, C], value j of each eight in bits 4j.."""
    v = q.to(torch.int64).view(-1, 8, q.shape[1])
    out = torch.zeros(v.shape[0], q.shape[1], dtype=torch.int64)
    for j in range(8):
        out |= v[:, j] << (4 * j)
    return _as_int32(out)


def _pack_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8C] 4-bit values -> int32 [R, C], nibble i holding column 8c + order[i]."""
    v = q.to(torch.int64).view(q.shape[0], -1, 8)
    out = torch.zeros(v.shape[0], v.shape[1], dtype=torch.int64)
    for i in range(8):
        out |= v[:, :, order[i]] << (4 * i)
    return _as_int32(out)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns as the int32 tensors the formats store (the top nibble sets the sign)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _asymmetric(w: torch.Tensor, group: int, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (inputs already in group order) -> q 0..15 [N, K], scales fp16 [G, N], integer zeros [G, N]
    with w ~ scale (q - zero); the scale rounded to fp16 first, as it is stored. ``min_zero``: GPTQ's format
    stores zero - 1 in four bits, so its zeros start at 1."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    zero = torch.round(-lo / scale).clamp(min_zero, 15)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15).view(n, k)
    return q.to(torch.uint8), scale.T.half().contiguous(), zero.T.to(torch.int64).contiguous()


def input_site(name: str) -> str:
    """Layers that read the same input (q / k / v, gate / up) share a site: GPTQ's act-order orders a layer's
    inputs by its input's statistics, so theirs is one order (our fused layers need it)."""
    prefix, _, rest = name.rpartition(".layers.")
    index, _, module = rest.partition(".")
    role = module.rsplit(".", 2)[-2]
    site = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in",
            "up_proj": "mlp_in"}.get(role, role)
    return f"{prefix}.layers.{index}.{site}"


def act_orders(state: dict) -> dict[str, torch.Tensor]:
    """An input order per site: inputs by decreasing total magnitude of the weights that read them (a stand-in
    for GPTQ's order by the Hessian's diagonal, which needs calibration data)."""
    mass: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_quantized_layer(name, tensor):
            site = input_site(name)
            mass[site] = mass.get(site, 0) + tensor.float().abs().sum(0)
    return {site: torch.argsort(m, descending=True) for site, m in mass.items()}


def _symmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``_asymmetric`` with GPTQ's symmetric grid: zero 8, scale 2 absmax / 15 per group."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-8).half().float()
    q = torch.clamp(torch.round(g / scale[..., None]) + 8, 0, 15).view(n, k)
    return q.to(torch.uint8), scale.T.half().contiguous(), torch.full_like(scale.T, 8, dtype=torch.int64)


def gptq_layer(w: torch.Tensor, group: int, perm: torch.Tensor | None, sym: bool = False) -> tuple[dict, torch.Tensor]:
    """(qweight, qzeros, scales, g_idx) of one layer (``perm``: act-order's input order, None: none; ``sym``:
    zero 8 everywhere, as vLLM's CPU kernels require), and the weight they stand for (float32 [N, K])."""
    n, k = w.shape
    perm = torch.arange(k) if perm is None else perm
    q_p, scales, zeros = _symmetric(w[:, perm], group) if sym else _asymmetric(w[:, perm], group, min_zero=1)
    q = torch.empty_like(q_p)
    q[:, perm] = q_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    tensors = {"qweight": _pack_rows(q.T.contiguous()), "qzeros": _pack_cols(zeros - 1),
               "scales": scales, "g_idx": g_idx}
    deq = scales.float()[g_idx.long()].T * (q.float() - zeros.float()[g_idx.long()].T)
    return tensors, deq


def awq_layer(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    q, scales, zeros = _asymmetric(w, group)
    g = torch.arange(w.shape[1]) // group
    tensors = {"qweight": _pack_cols(q.T.contiguous(), AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER),
               "scales": scales}
    return tensors, scales.float()[g].T * (q.float() - zeros.float()[g].T)


def w8a8_layer(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).bfloat16().float()
    q = torch.clamp(torch.round(w / scale), -128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": scale.bfloat16()}, q * scale


def w4a16_layer(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).bfloat16().float()  # [N, G]
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7).view(n, k)
    tensors = {"weight_packed": _pack_cols((q + 8).to(torch.uint8)), "weight_scale": scale.bfloat16(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return tensors, (q.view(n, -1, group) * scale[..., None]).view(n, k)


def quantization_config(fmt: str, group: int, act_order: bool, sym: bool = False) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    weights = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"} if fmt == "w8a8" else
               {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group})
    group0 = {"targets": ["Linear"], "weights": weights}
    if fmt == "w8a8":
        group0["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "int-quantized" if fmt == "w8a8" else "pack-quantized",
            "config_groups": {"group_0": group0}, "ignore": ["lm_head"]}


def quantize_checkpoint(src: str, dst: str, fmt: str, *, group_size: int = 128, act_order: bool = False,
                        sym: bool = False, reference: str | None = None) -> dict:
    """Write ``src`` quantized as ``fmt`` to ``dst`` (and dequantized to ``reference``); returns the
    quantization_config written."""
    from safetensors.torch import save_file

    from apt_serve_ray.models.loader import load_config, load_state_dict, load_tokenizer, resolve_model

    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {FORMATS}, got {fmt!r}")
    if (act_order or sym) and fmt != "gptq":
        raise ValueError("act_order / sym: GPTQ only")
    source = resolve_model(src)
    if source.gguf_file is None:
        config = json.loads((Path(source.directory) / "config.json").read_text())
    else:  # a GGUF (the default model): its config and tokenizer as transformers reads them
        config = load_config(source).to_dict()
    state = load_state_dict(source, torch.float32)
    if config.get("tie_word_embeddings", True) and "model.embed_tokens.weight" in state:
        state.pop("lm_head.weight", None)  # tied: the embedding stands for it (as transformers saves it)
    orders = act_orders(state) if act_order else {}
    out, ref = {}, {}
    for name, tensor in state.items():
        if not is_quantized_layer(name, tensor):
            out[name] = ref[name] = tensor.clone()  # no storage shared with another (safetensors refuses it)
            continue
        k = tensor.shape[1]
        group = group_size if group_size > 0 else k
        if fmt != "w8a8" and (k % group or k % 8 or tensor.shape[0] % 8):  # w8a8: per channel, no groups
            raise ValueError(f"group_size: {name} [{tensor.shape[0]}, {k}] is not whole groups of {group} "
                             "(and of 8 inputs and outputs)")
        prefix = name[: -len("weight")]
        w = tensor.float()
        tensors, deq = {"gptq": lambda: gptq_layer(w, group, orders.get(input_site(name)), sym), "awq": lambda: awq_layer(w, group),
                        "w8a8": lambda: w8a8_layer(w), "w4a16": lambda: w4a16_layer(w, group)}[fmt]()
        out.update({prefix + key: value for key, value in tensors.items()})
        ref[name] = deq.contiguous()
    qconfig = quantization_config(fmt, group_size, act_order, sym)
    for folder, tensors, extra in ((dst, out, {"quantization_config": qconfig}), (reference, ref, {})):
        if folder is None:
            continue
        Path(folder).mkdir(parents=True, exist_ok=True)
        if source.gguf_file is not None:
            load_tokenizer(source).save_pretrained(folder)
        else:
            for f in Path(source.directory).iterdir():  # tokenizer and generation files
                if f.is_file() and f.suffix in (".json", ".txt", ".model") and f.name != "config.json":
                    shutil.copy(f, Path(folder) / f.name)
        (Path(folder) / "config.json").write_text(json.dumps({**config, **extra, "torch_dtype": "float32"}, indent=2))
        save_file(tensors, str(Path(folder) / "model.safetensors"))
    return qconfig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--group-size", type=int, default=128, help="inputs per group (-1: one per output channel)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: groups over the inputs by decreasing weight")
    p.add_argument("--sym", action="store_true", help="GPTQ: the symmetric grid (zero 8; vLLM's CPU build needs it)")
    p.add_argument("--reference", default=None, help="also write the dequantized full-width model here")
    args = p.parse_args(argv)
    qconfig = quantize_checkpoint(args.src, args.dst, args.format, group_size=args.group_size,
                                  act_order=args.act_order, sym=args.sym, reference=args.reference)
    print(f"written: {args.dst} ({json.dumps(qconfig)})")


if __name__ == "__main__":
    main()

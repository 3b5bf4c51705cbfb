"""Checkpoints that arrive quantized (issue 43): GPTQ, AWQ and compressed-tensors read in their codes and
served in them, against the same model dequantized to full width through transformers."""

from __future__ import annotations

import json

import pytest
import torch

from apt_serve_ray import LLM
from apt_serve_ray.models.checkpoint_quant import AWQ_ORDER, QuantizedWeight, _unpack_cols, _unpack_rows
from apt_serve_ray.models.linear import weight_bytes
from apt_serve_ray.models.quant import Int4Linear, Int8Linear
from apt_serve_ray.models.quantize_checkpoint import quantize_checkpoint

IDS = list(range(5, 90))
FORMATS = [("gptq", False), ("gptq", True), ("gptq-sym", False), ("awq", False), ("w8a8", False), ("w4a16", False)]


def _word(values: list[int]) -> int:
    """Eight 4-bit values as the int32 the formats store: value j in bits 4j.. (as written out in the spec)."""
    word = sum(v << (4 * j) for j, v in enumerate(values))
    return word - (1 << 32) if word >= 1 << 31 else word


def test_unpacking_follows_the_formats_bit_layouts():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 3), generator=g)  # [K, N]
    # GPTQ's qweight: eight inputs of one output per int32, input 8r + j in bits 4j.
    qweight = torch.tensor([[_word([int(q[8 * r + j, n]) for j in range(8)]) for n in range(3)] for r in range(2)],
                           dtype=torch.int32)
    assert torch.equal(_unpack_rows(qweight).long(), q)
    # AWQ's: eight outputs per int32, nibble i holding output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i].
    cols = torch.randint(0, 16, (2, 16), generator=g)  # [K, N]
    packed = torch.tensor([[_word([int(cols[k, 8 * c + AWQ_ORDER[i]]) for i in range(8)]) for c in range(2)]
                           for k in range(2)], dtype=torch.int32)
    assert torch.equal(_unpack_cols(packed, AWQ_ORDER).long(), cols)


def _reference_logits(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("shape", ["llama-tiny-gqa", "opt-tiny"])
@pytest.mark.parametrize("fmt,act_order", FORMATS)
def test_a_quantized_checkpoint_is_served_in_its_codes(checkpoint, tmp_path, shape, fmt, act_order):
    """Its layers stay packed (4 or 8 bits), and its logits are the dequantized model's (transformers, float32)
    as closely as bf16 full width's are the full-width model's."""
    src = checkpoint(shape)
    dst, ref = str(tmp_path / "q"), str(tmp_path / "ref")
    sym = fmt == "gptq-sym"
    fmt = fmt.removesuffix("-sym")
    qconfig = quantize_checkpoint(src, dst, fmt, group_size=32, act_order=act_order, sym=sym, reference=ref)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == qconfig
    kw = dict(dtype="bfloat16", num_pages=64, calibrate_rho=False, enable_watermarks=False)
    llm = LLM(dst, **kw)
    layers = llm.llm_engine.runner.model.layers
    kind = Int8Linear if fmt == "w8a8" else Int4Linear
    assert all(isinstance(getattr(lay, name), kind) for lay in layers for name in ("qkv", "out"))
    if act_order:
        assert layers[0].qkv.perm is not None
    want = _reference_logits(ref)
    got = llm.llm_engine.prompt_logits(IDS).float()
    bf16 = LLM(ref, **kw).llm_engine.prompt_logits(IDS).float()  # the dequantized weights rounded to bf16
    assert (got - want).abs().max() <= 2 * (bf16 - want).abs().max() + 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    full = sum(weight_bytes(lay.qkv) for lay in LLM(ref, **kw).llm_engine.runner.model.layers)
    assert sum(weight_bytes(lay.qkv) for lay in layers) < (0.7 if fmt == "w8a8" else 0.45) * full


def test_float32_widens_the_codes_to_full_width(checkpoint, tmp_path):
    """Our kernels take bf16 activations: in float32 the checkpoint is served widened, equal to the reference."""
    dst, ref = str(tmp_path / "q"), str(tmp_path / "ref")
    quantize_checkpoint(checkpoint("llama-tiny-gqa"), dst, "gptq", group_size=32, act_order=True, reference=ref)
    llm = LLM(dst, dtype="float32", num_pages=64, calibrate_rho=False, enable_watermarks=False)
    torch.testing.assert_close(llm.llm_engine.prompt_logits(IDS).float(), _reference_logits(ref), atol=2e-3, rtol=1e-3)


def test_quantization_contradicting_the_checkpoint_is_refused_naming_the_field(checkpoint, tmp_path):
    src = checkpoint("opt-tiny")
    dst = str(tmp_path / "q")
    quantize_checkpoint(src, dst, "awq", group_size=32)
    kw = dict(dtype="bfloat16", num_pages=32, calibrate_rho=False)
    with pytest.raises(ValueError, match="quantization: .* is already quantized \\(awq\\)"):
        LLM(dst, quantization="int4", **kw)
    with pytest.raises(ValueError, match="quantization: 'gptq' reads a checkpoint quantized with it"):
        LLM(src, quantization="gptq", **kw)
    assert isinstance(LLM(dst, quantization="awq", **kw).llm_engine.runner.model.layers[0].out, Int4Linear)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization: AWQ gemm with 3 bits"):
        LLM(dst, **kw)


def test_fused_projections_need_one_input_order():
    a = QuantizedWeight(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), torch.arange(32))
    b = QuantizedWeight(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1),
                        torch.arange(32).flip(0))
    assert QuantizedWeight.cat([a, a]).codes.shape == (16, 32)
    with pytest.raises(ValueError, match="act-order"):
        QuantizedWeight.cat([a, b])


def test_the_default_model_written_as_w8a8_serves_from_its_gguf(smollm2, tmp_path):
    """quantize_checkpoint takes the shipped GGUF (its config and tokenizer written beside the weights), and the
    W8A8 checkpoint it writes answers as the model does, teacher-forced."""
    dst = str(tmp_path / "w8a8")
    quantize_checkpoint("smollm2-135m-instruct", dst, "w8a8")
    llm = LLM(dst, dtype="bfloat16", num_pages=64, calibrate_rho=False, enable_watermarks=False)
    assert isinstance(llm.llm_engine.runner.model.layers[0].gate_up, Int8Linear)
    ids = llm.get_tokenizer().encode("The capital of France is Paris. Once upon a time, in a village")
    assert ids == smollm2.get_tokenizer().encode("The capital of France is Paris. Once upon a time, in a village")
    want = smollm2.llm_engine.prompt_logits(ids).float()
    assert (llm.llm_engine.prompt_logits(ids).float().argmax(-1) == want.argmax(-1)).float().mean() >= 0.9

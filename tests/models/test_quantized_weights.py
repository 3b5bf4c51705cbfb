"""Weights kept quantized (``quantization``, issue 43): the packed kernels against the weights they stand
for, the default model's shipped 4-bit codes kept, the hidden kinds against the KV kind under them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apt_serve_ray import LLM, EngineConfig, SamplingParams
from apt_serve_ray.models.linear import weight_bytes
from apt_serve_ray.models.quant import (INT4_GROUP, Int4Linear, Int8Linear, dequantize_int4, native_int8_kernel,
                                        quantize_int4, quantized_linear)


def _reference(layer, weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight a quantized layer stands for."""
    if isinstance(layer, Int8Linear):
        return layer.dequantize()
    return dequantize_int4(*quantize_int4(weight))


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernels_match_the_weights_they_stand_for(kind, dtype):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 4 * INT4_GROUP, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, 3, weight.shape[1], generator=g).to(dtype)  # rows of any rank
    layer = kind(weight, bias)
    y = layer(x)
    ref = F.linear(x.float(), _reference(layer, weight), bias.float())
    assert y.shape == (2, 3, 96) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()
    # And the reference is close to the full-width weight: int8 within a step of 1/127 of a row's range.
    step = weight.float().abs().amax(1, keepdim=True) / 127 if kind is Int8Linear else None
    if step is not None:
        assert ((_reference(layer, weight) - weight.float()).abs() <= step * 0.51 + 1e-2).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33])
def test_the_int8_kernel_matches_its_reference_at_any_rows_and_a_tail_of_channels(rows):
    """Our kernel (AVX-512 BF16: blocks of 16 channels, 4 rows a pass, 1-3 rows left over; torch's kernel
    where the CPU lacks it) against the float32 product with the weight it stands for; 100 channels: the
    last block is part-filled (masked stores), and its padding never leaks into y."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(100, 192, generator=g).to(torch.bfloat16)
    bias = torch.randn(100, generator=g).to(torch.bfloat16)
    layer = Int8Linear(weight, bias)
    x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
    y = layer(x)
    ref = F.linear(x.float(), layer.dequantize(), bias.float())
    assert y.shape == (rows, 100)
    assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_a_prefill_sized_batch_multiplies_the_widened_weight_the_kernel_stands_for(kind):
    """From WIDEN_ROWS rows the layer widens its codes into a bf16 scratch and multiplies that (a GEMM): the
    same weight as the kernel's, 100 channels (a part-filled last block: its padding never reaches y)."""
    from apt_serve_ray.models.quant import WIDEN_ROWS

    g = torch.Generator().manual_seed(3)
    n = 100 if native_int8_kernel() else 96  # torch's int4 packing (where ours does not build) wants N by 16
    weight = torch.randn(n, 4 * INT4_GROUP, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    layer = kind(weight, bias)
    rows = WIDEN_ROWS["int8" if kind is Int8Linear else "int4"] + 3
    x = torch.randn(rows, weight.shape[1], generator=g).to(torch.bfloat16)
    y = layer(x)
    ref = F.linear(x.float(), _reference(layer, weight), bias.float())
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    small = layer(x[:5])  # the kernel's path: the same rows give the same values, to bf16 rounding
    assert (small.float() - y[:5].float()).abs().max() <= 2e-2 * ref.abs().max()


def test_weights_on_a_q4_1_grid_keep_their_codes():
    """The default model ships as Q4_1 (w = d q + m, q in 0..15, each block's min at 0 and max at 15):
    quantizing its dequantized weights gives back the same codes, so int4 serves the shipped 4-bit model."""
    g = torch.Generator().manual_seed(1)
    n, k = 8, 4 * INT4_GROUP
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // INT4_GROUP, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // INT4_GROUP, generator=g) * 0.1
    w = (q * d[..., None] + m[..., None]).view(n, k)
    codes, scales, minima = quantize_int4(w)
    assert torch.equal(codes, q.view(n, k).to(codes.dtype))
    torch.testing.assert_close(dequantize_int4(codes, scales, minima), w, atol=1e-6, rtol=0)


def test_a_layer_whose_inputs_are_not_whole_groups_falls_back_to_int8():
    layer = quantized_linear(torch.randn(16, INT4_GROUP + 8), None, "int4")
    assert isinstance(layer, Int8Linear)


def test_the_default_model_in_int4_is_its_shipped_4_bit_self(smollm2):
    """Its 4-bit codes kept, in bf16 the int4 model is about as far from float32 full width (the GGUF
    dequantized) as bf16 full width is, in a third of the bytes, and answers a chat as full width does."""
    kw = dict(dtype="bfloat16", num_pages=64, max_num_batched_tokens=512, calibrate_rho=False, enable_watermarks=False)
    quant = LLM("smollm2-135m-instruct", quantization="int4", **kw)
    plain = LLM("smollm2-135m-instruct", **kw)
    tok = smollm2.get_tokenizer()
    errors = {"quant": [], "plain": []}
    for prompt in ("def fibonacci(n):\n    ", "The capital of France is", "Once upon a time, in a village"):
        ids = tok.encode(prompt)
        ref = smollm2.llm_engine.prompt_logits(ids)  # float32, full width
        for name, llm in (("quant", quant), ("plain", plain)):
            logits = llm.llm_engine.prompt_logits(ids).float()
            errors[name].append((logits - ref).abs().max())
            if name == "quant":  # teacher-forced: the same next token at every position
                assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9, prompt
    assert max(errors["quant"]) < 1.5 * max(errors["plain"]), errors
    if native_int8_kernel():  # our int4 kernel (d and m in float32); torch's holds them in bf16 and answered
        # this one "L'Étoile, la Marseur, la France, ..." from the first token
        chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       add_generation_prompt=True)
        chat = chat if isinstance(chat, list) else chat["input_ids"]
        params = SamplingParams(temperature=0, max_tokens=16)
        assert (quant.generate([chat], params)[0].outputs[0].text == plain.generate([chat], params)[0].outputs[0].text
                == "The capital of France is Paris.")

    def layer_bytes(llm):
        return sum(weight_bytes(lin) for lay in llm.llm_engine.runner.model.layers
                   for lin in (lay.qkv, lay.out, lay.gate_up, lay.down))

    assert layer_bytes(quant) < 0.4 * layer_bytes(plain)  # 4 bits + a float32 d and m per 32 (torch's: bf16), vs 16


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny-gqa"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_hidden_kinds_match_kv_under_quantized_weights(checkpoint, shape, quantization):
    """The hidden kinds project K/V from stored x with the K/V rows the quantized layer multiplies by
    (kept dequantized), so they agree with the KV kind as at full width; every page comes back."""
    kw = dict(dtype="bfloat16", num_pages=128, calibrate_rho=False, enable_watermarks=False)
    llm = LLM(checkpoint(shape), quantization=quantization, force_hidden=True, cache_kinds=["hidden"],
              policy="sarathi", **kw)
    engine = llm.llm_engine
    ids = list(range(5, 150))
    kv = engine.prompt_logits(ids, "kv").float()
    assert (engine.prompt_logits(ids, "hidden").float() - kv).abs().max() < 0.05 * kv.std()
    full = LLM(checkpoint(shape), **kw).llm_engine.prompt_logits(ids).float()
    # And near full width (16 levels a group of random Gaussian weights is a coarse grid: the mean error)
    assert (kv - full).abs().mean() < (0.05 if quantization == "int8" else 0.25) * kv.std()
    llm.adjust_cache_ratio(1.0)
    hidden = llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert {o.metrics.cache_kind for o in hidden} == {"hidden"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in hidden)
    assert engine.cache.pool.num_free_pages == engine.cache.pool.num_pages


def test_quantization_is_validated():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="quantization.*bfloat16"):  # torch's packed kernels crawl in float32
        EngineConfig(quantization="int4", dtype="float32")


def test_a_memory_budget_gives_the_cache_what_the_weights_leave(checkpoint):
    """``memory_budget_bytes``: the weights and the cache together; weights kept quantized leave the cache the
    bytes they save, page for page. A budget the weights alone fill is refused, naming the field."""
    from apt_serve_ray.models.base import tensor_bytes

    path = checkpoint("opt-tiny")
    kw = dict(dtype="bfloat16", memory_budget_bytes=16 << 20, calibrate_rho=False, enable_watermarks=False)
    full, quant = LLM(path, **kw).llm_engine.runner, LLM(path, quantization="int4", **kw).llm_engine.runner
    for runner in (full, quant):
        assert runner.num_pages == ((16 << 20) - tensor_bytes(runner.model)) // runner.layout.bytes_per_page
    assert tensor_bytes(quant.model) < tensor_bytes(full.model) and quant.num_pages > full.num_pages
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        LLM(path, dtype="bfloat16", memory_budget_bytes=1024, calibrate_rho=False)


def test_int4_with_dtype_auto_on_a_cpu_without_native_bf16_serves_full_width(checkpoint, monkeypatch, caplog):
    """serve_config.yaml asks for int4 with dtype auto: where auto means float32 (no native bf16), the model is
    served at full width with a warning, not refused; an explicit float32 is still refused."""
    from apt_serve_ray.worker import model_runner

    monkeypatch.setattr(model_runner, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="apt_serve_ray"):
        llm = LLM(checkpoint("opt-tiny"), dtype="auto", quantization="int4", num_pages=32, calibrate_rho=False)
    assert llm.llm_engine.runner.dtype == torch.float32
    assert not isinstance(llm.llm_engine.runner.model.layers[0].out, (Int4Linear, Int8Linear))
    assert "served at full width" in caplog.text
    with pytest.raises(ValueError, match="quantization"):
        LLM(checkpoint("opt-tiny"), dtype="float32", quantization="int4", num_pages=32)

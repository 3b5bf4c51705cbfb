"""Our model code against transformers on the same weights: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch

from apt_serve_ray import LLM, SamplingParams

LONG = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(80))  # > 300 tokens
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG]


def _hf(path_or_source, gguf_file=None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path_or_source, gguf_file=gguf_file, dtype=torch.float32).eval()


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _check_against_hf(llm: LLM, hf, num_tokens: int) -> None:
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    assert len(tok.encode(LONG)) > 300
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, num_tokens), prompt[:30]
        full = ids + out.outputs[0].token_ids
        ours = llm.llm_engine.prompt_logits(full)
        ref = _hf_logits(hf, full)
        assert torch.allclose(ours, ref, atol=1e-3, rtol=0), (ours - ref).abs().max()


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    src = smollm2.llm_engine.source
    _check_against_hf(smollm2, _hf(src.directory, src.gguf_file), num_tokens=16)


NEW_ARCHITECTURES = ["qwen2-tiny", "qwen3-tiny", "qwen3-tiny-gqa", "mistral-tiny", "phi3-tiny",
                     "gemma-tiny", "gemma2-tiny", "gemma3-tiny"]


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny", "llama-tiny-gqa", "llama-tiny-untied", *NEW_ARCHITECTURES,
                                   "qwen2-tiny-swa"])
def test_random_checkpoints_match_transformers(checkpoint, shape):
    path = checkpoint(shape)
    llm = LLM(path, dtype="float32", num_pages=256, max_num_batched_tokens=128)
    _check_against_hf(llm, _hf(path), num_tokens=24)


def test_checkpoints_take_the_tokenizer_from_a_folder_when_told(tmp_path, monkeypatch):
    # What benchmarks/gpu_check.sh does on a machine without the default model: the same tokenizer,
    # saved as a folder, makes the same checkpoint.
    from apt_serve_ray.models.checkpoints import _tokenizer, make_random_checkpoint

    default = _tokenizer()
    default.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("APT_SERVE_CHECKPOINT_TOKENIZER", str(tmp_path / "tok"))
    folder = _tokenizer()
    assert len(folder) == len(default) and folder.eos_token_id == default.eos_token_id
    assert folder.encode(LONG) == default.encode(LONG)
    path = make_random_checkpoint(tmp_path / "ckpt", "opt-tiny")
    out = LLM(path, dtype="float32", num_pages=32).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("shape", NEW_ARCHITECTURES)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_new_architectures_hidden_and_int8_kinds_match_kv(checkpoint, shape, backend):
    """The hidden kind projects K/V from stored x as the model does (Qwen3's k norm, Phi-3's partial
    rotary, the biases) at the tokens' positions; the int8 kinds stay within their bound."""
    kw = dict(dtype="float32", num_pages=256, attention_backend=backend, force_hidden=True, policy="sarathi",
              enable_watermarks=False, calibrate_rho=False)
    engine = LLM(checkpoint(shape), cache_kinds=["hidden", "kv-int8", "hidden-int8"], **kw).llm_engine
    ids = engine.tokenizer.encode(LONG)[:200]
    kv = engine.prompt_logits(ids, "kv")
    torch.testing.assert_close(engine.prompt_logits(ids, "hidden"), kv, atol=1e-4, rtol=0)
    for kind in ("kv-int8", "hidden-int8"):
        assert (engine.prompt_logits(ids, kind) - kv).abs().max() < 0.15 * kv.std(), kind
    # Decode rows (the fused hidden kernels where the projection allows) against the KV cache.
    prompts = [LONG[:200], PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(checkpoint(shape), cache_kinds=["hidden"], **kw)  # sarathi: new requests hidden under the ratio
    llm.adjust_cache_ratio(1.0)
    hidden = llm.generate(prompts, params)
    llm.adjust_cache_ratio(0.0)
    kv_out = llm.generate(prompts, params)
    assert {o.metrics.cache_kind for o in hidden} == {"hidden"} and {o.metrics.cache_kind for o in kv_out} == {"kv"}
    assert [o.outputs[0].token_ids for o in hidden] == [o.outputs[0].token_ids for o in kv_out]


def test_sliding_window_layers_attend_within_their_window_at_any_length(checkpoint):
    """Mistral (every layer) and Qwen2 with use_sliding_window (layers from max_window_layers on) mask
    what lies behind the window (48 here) instead of capping the context; a window no shorter than
    max_model_len masks nothing, so those layers keep the fast path."""
    mistral = LLM(checkpoint("mistral-tiny"), dtype="float32", num_pages=256).llm_engine
    assert mistral.max_model_len == 2048 and mistral.runner.model.windows == [48, 48]
    qwen2 = LLM(checkpoint("qwen2-tiny-swa"), dtype="float32", num_pages=256).llm_engine
    assert qwen2.runner.model.windows == [None, 48]
    short = LLM(checkpoint("mistral-tiny"), dtype="float32", num_pages=256, max_model_len=48).llm_engine
    assert short.runner.model.windows == [None, None]


def test_gemma_attends_within_its_window_at_any_length(checkpoint):
    """Gemma 2 / 3's local layers (window 48 here) mask what lies behind the window instead of capping
    the context; _check_against_hf's long prompt (> 300 tokens) and its decode steps run past it."""
    engine = LLM(checkpoint("gemma3-tiny"), dtype="float32", num_pages=256).llm_engine
    assert engine.max_model_len == 2048 and engine.runner.model.windows == [48, None, 48]
    assert LLM(checkpoint("gemma2-tiny"), dtype="float32", num_pages=256).llm_engine.runner.model.attn_softcap == 3.0


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones():
    from apt_serve_ray.models import model_class

    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; supported: .*'phi3', 'qwen2', 'qwen3'"):
        model_class("gpt2")


@pytest.mark.parametrize("shape", ["opt-tiny", *NEW_ARCHITECTURES])
def test_bfloat16_stays_close_to_transformers(checkpoint, shape):
    """bf16 cannot match bit for bit (different op order); logits stay within bf16 noise."""
    from transformers import AutoModelForCausalLM

    path = checkpoint(shape)
    llm = LLM(path, dtype="bfloat16", num_pages=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = llm.get_tokenizer().encode(PROMPTS[0] + " and the capital of Spain is")
    ours = llm.llm_engine.prompt_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()

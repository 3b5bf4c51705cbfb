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


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny", "llama-tiny-gqa"])
def test_random_checkpoints_match_transformers(checkpoint, shape):
    path = checkpoint(shape)
    llm = LLM(path, dtype="float32", num_pages=256, max_num_batched_tokens=128)
    _check_against_hf(llm, _hf(path), num_tokens=24)


def test_bfloat16_stays_close_to_transformers(opt_tiny):
    """bf16 cannot match bit for bit (different op order); logits stay within bf16 noise."""
    from transformers import AutoModelForCausalLM

    llm = LLM(opt_tiny, dtype="bfloat16", num_pages=64)
    hf = AutoModelForCausalLM.from_pretrained(opt_tiny, dtype=torch.bfloat16).eval()
    ids = llm.get_tokenizer().encode(PROMPTS[0] + " and the capital of Spain is")
    ours = llm.llm_engine.prompt_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()

"""LoRA adapters (issue 43, item 3): our engine against PEFT over transformers on the same adapter, several
adapters in one step, cached prefixes per adapter, refusals, and the slots freed on unload."""

from __future__ import annotations

import json
import os

import pytest
import torch

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.request import CacheKind

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _peft(base: str, out: str, targets, *, r: int, alpha: float, seed: int, rslora: bool = False):
    """A random PEFT adapter over ``base`` (B not zero: init_lora_weights=False), saved to ``out``; the
    PEFT model (the reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                          init_lora_weights=False, use_rslora=rslora))
    model.save_pretrained(out)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per base shape: the checkpoint and two adapters (different targets, ranks, scalings) with their
    PEFT references."""
    made = {}

    def make(shape):
        if shape not in made:
            base = checkpoint(shape)
            root = tmp_path_factory.mktemp(f"lora-{shape}")
            attn = ["q_proj", "v_proj"] if shape.startswith(("opt", "llama")) else ["qkv_proj"]
            mlp = {"opt": ["fc1", "fc2", "out_proj"], "phi3": ["gate_up_proj", "down_proj", "o_proj"]}.get(
                shape.split("-")[0], ["gate_proj", "up_proj", "down_proj", "o_proj", "k_proj"])
            a = _peft(base, str(root / "a"), attn, r=8, alpha=16, seed=1)
            b = _peft(base, str(root / "b"), attn + mlp, r=4, alpha=8, seed=2, rslora=True)
            made[shape] = (base, {"a": (str(root / "a"), a), "b": (str(root / "b"), b)})
        return made[shape]

    return make


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny-gqa", "phi3-tiny"])
def test_adapters_match_peft_over_transformers(adapters, shape):
    base, made = adapters(shape)
    llm = LLM(base, dtype="float32", num_pages=256, max_num_batched_tokens=128,
              lora_modules=tuple(f"{n}={p}" for n, (p, _) in made.items()), max_loras=2, max_lora_rank=8)
    tok = llm.get_tokenizer()
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    # One batch: base rows and both adapters' rows in the same steps (prefill and decode).
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora_name=names)
    for prompt, name, out in zip(prompts, names, outs):
        ref = plain if name is None else made[name][1]
        ids = tok.encode(prompt)
        assert out.outputs[0].token_ids == _greedy(ref, ids, 12), (name, prompt)
        full = ids + out.outputs[0].token_ids
        ours, want = llm.llm_engine.prompt_logits(full, lora_name=name), _logits(ref, full)
        assert torch.allclose(ours, want, atol=1e-3, rtol=0), (name, (ours - want).abs().max())
    # The adapters change the output (the test would pass trivially otherwise).
    ids = tok.encode(PROMPTS[0])
    assert not torch.allclose(_logits(made["a"][1], ids), _logits(plain, ids), atol=1e-2)
    assert llm.llm_engine.cache.pool.num_free_pages == llm.llm_engine.cache.pool.num_pages


def test_bf16_and_quantized_weights_take_adapters_too(adapters):
    """What the adapter changes (its logits less the base model's) is what PEFT's changes, in bf16 over
    full-width, int8 and int4 weights (measured: cosine 0.9999 / 0.9998 / 0.996, norms within 0.1%)."""
    from transformers import AutoModelForCausalLM

    base, made = adapters("llama-tiny-gqa")
    ids = LLM(base, dtype="float32", num_pages=64).get_tokenizer().encode(" ".join(PROMPTS))
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    want = (_logits(made["b"][1], ids) - _logits(plain, ids)).flatten()
    for quantization in (None, "int8", "int4"):
        llm = LLM(base, dtype="bfloat16", num_pages=64, quantization=quantization,
                  lora_modules=(f"b={made['b'][0]}",), max_lora_rank=8)
        engine = llm.llm_engine
        got = (engine.prompt_logits(ids, lora_name="b") - engine.prompt_logits(ids)).flatten()
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99, quantization
        assert abs(got.norm() / want.norm() - 1) < 0.02, quantization


def test_an_adapters_cached_prefix_serves_only_that_adapter(adapters):
    base, made = adapters("opt-tiny")
    llm = LLM(base, dtype="float32", num_pages=256, lora_modules=tuple(f"{n}={p}" for n, (p, _) in made.items()),
              max_loras=2, max_lora_rank=8, enable_prefix_caching=True)
    prompt = " ".join(["a shared system prompt"] * 12)
    sp = SamplingParams(temperature=0, max_tokens=2)

    def cached(name):
        return llm.generate([prompt], sp, lora_name=[name])[0].num_cached_tokens or 0

    assert cached("a") == 0
    assert cached("a") > 0  # the same adapter finds its pages
    assert cached("b") == 0  # another adapter does not
    assert cached(None) == 0  # nor the base model


def test_adapters_are_loaded_and_unloaded_at_run_time(adapters):
    base, made = adapters("opt-tiny")
    llm = LLM(base, dtype="float32", num_pages=128, max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    assert engine.list_loras() == {}
    with pytest.raises(ValueError, match="model: no LoRA adapter named 'a'"):
        engine.make_request(PROMPTS[0], lora_name="a")
    engine.add_lora("a", made["a"][0])
    assert engine.list_loras() == {"a": made["a"][0]}
    assert engine.loaded_loras() == (("a",), ())
    # One slot: a second adapter takes it from the idle first one, which stays registered.
    engine.add_lora("b", made["b"][0])
    assert engine.list_loras() == {"a": made["a"][0], "b": made["b"][0]}
    assert engine.loaded_loras() == (("b",), ())
    with pytest.raises(ValueError, match="lora_name: an adapter named 'a' is already loaded"):
        engine.add_lora("a", made["a"][0])
    # A request for "a" loads it back; one for "b" meanwhile waits for the slot, then runs.
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], sp, lora_name="a")
    engine.step()
    assert engine.loaded_loras() == (("a",), ("a",))
    second = engine.add_request(PROMPTS[1], sp, lora_name="b")
    assert second.lora is None and engine.cache_stats().num_waiting == 1
    engine.remove_lora("a")  # still running: it finishes with its adapter, then the slot is free
    while engine.has_unfinished_requests():
        engine.step()
    assert first.num_output_tokens == 8 and second.num_output_tokens == 8
    assert engine.list_loras() == {"b": made["b"][0]}
    with pytest.raises(ValueError, match="lora_name: no adapter named 'a'"):
        engine.remove_lora("a")


def test_more_adapters_than_slots_serve_in_turn_as_with_slots_enough(adapters):
    """lora_modules beyond max_loras (vLLM's): requests of three adapters over one slot give what three
    slots give; a request whose adapter has no slot waits for one, and one aborted while waiting ends."""
    base, made = adapters("opt-tiny")
    modules = tuple(f"{n}={p}" for n, (p, _) in made.items())
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    names = [n for n in made] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    one = LLM(base, dtype="float32", num_pages=128, lora_modules=modules, max_loras=1, max_lora_rank=8)
    enough = LLM(base, dtype="float32", num_pages=128, lora_modules=modules, max_lora_rank=8)
    got = [o.outputs[0].token_ids for o in one.generate(prompts, sp, lora_name=names)]
    want = [o.outputs[0].token_ids for o in enough.generate(prompts, sp, lora_name=names)]
    assert got == want
    engine = one.llm_engine
    assert engine.runner.lora.num_slot_loads >= len(made)
    running = engine.add_request(PROMPTS[0], sp, lora_name=names[0])
    other = next(n for n in made if n != names[0])
    waiting = engine.add_request(PROMPTS[1], sp, lora_name=other)
    engine.step()
    assert waiting.lora is None
    assert engine.abort_request(waiting.request_id).finished
    while engine.has_unfinished_requests():
        engine.step()
    assert running.num_output_tokens == 6 and not engine.requests
    engine.check_integrity()


def test_a_request_waiting_for_a_slot_is_not_overtaken_for_ever(adapters, monkeypatch):
    """Past LORA_FAIR_WAIT_S, a request waiting for an adapter slot lets no later adapter request start
    before it: requests of the adapter in the slot queue behind it, and the slot drains."""
    from apt_serve_ray.engine import lora_slots

    monkeypatch.setattr(lora_slots, "LORA_FAIR_WAIT_S", 0.0)
    base, made = adapters("opt-tiny")
    llm = LLM(base, dtype="float32", num_pages=128, lora_modules=tuple(f"{n}={p}" for n, (p, _) in made.items()),
              max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], sp, lora_name="a")
    engine.step()
    waiting = engine.add_request(PROMPTS[1], sp, lora_name="b")
    later = engine.add_request(PROMPTS[2], sp, lora_name="a")  # its adapter is in the slot, but b waits
    assert waiting.lora is None and later.lora is None
    base_row = engine.add_request(PROMPTS[2], sp)  # the base model needs no slot: never held back
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.num_output_tokens == 6 for r in (first, waiting, later, base_row))
    assert first.first_token_time < waiting.first_token_time < later.first_token_time
    assert base_row.first_token_time < waiting.first_token_time


def test_lora_turns_the_hidden_kinds_off(adapters):
    """Hidden pages hold x and project it to K/V with the base weights: an adapter on k or v would be lost."""
    base, made = adapters("opt-tiny")
    llm = LLM(base, dtype="float32", num_pages=64, lora_modules=(f"a={made['a'][0]}",), max_lora_rank=8,
              cache_kinds=("hidden", "kv-int8"))
    assert CacheKind.HIDDEN not in llm.llm_engine.compressed_kinds
    assert not llm.llm_engine.hidden_allowed


def _write_adapter(folder, config: dict, tensors: dict):
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))


def test_adapters_we_do_not_serve_are_refused_naming_the_field(checkpoint, tmp_path):
    base = checkpoint("opt-tiny")
    ok = {"base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
          "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}
    cases = {
        "use_dora": ({"r": 4, "use_dora": True}, ok),
        "r: the adapter's rank 32 exceeds max_lora_rank 8": ({"r": 32}, ok),
        "bias": ({"r": 4, "bias": "all"}, ok),
        "modules_to_save": ({"r": 4, "modules_to_save": ["lm_head"]}, ok),
        "target_modules": ({"r": 4}, {"base_model.model.model.decoder.layers.9.fc1.lora_A.weight": torch.zeros(4, 64),
                                      "base_model.model.model.decoder.layers.9.fc1.lora_B.weight": torch.zeros(128, 4)}),
        "has only lora_A": ({"r": 4}, {k: v for k, v in ok.items() if "lora_A" in k}),
        "expected": ({"r": 4}, {**ok, "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight":
                                torch.zeros(4, 32)}),
        "peft_type": ({"r": 4, "peft_type": "IA3"}, ok),
    }
    llm = LLM(base, dtype="float32", num_pages=32, max_loras=1, max_lora_rank=8)
    for i, (match, (config, tensors)) in enumerate(cases.items()):
        folder = str(tmp_path / f"bad{i}")
        _write_adapter(folder, config, tensors)
        with pytest.raises(ValueError, match=match):
            llm.llm_engine.add_lora("bad", folder)
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.llm_engine.add_lora("bad", str(tmp_path))
    assert llm.llm_engine.list_loras() == {}
    with pytest.raises(ValueError, match="lora_modules"):
        LLM(base, dtype="float32", num_pages=32, lora_modules=("no-equals-sign",))
    with pytest.raises(ValueError, match="max_loras: 0 turns LoRA off"):
        LLM(base, dtype="float32", num_pages=32, lora_modules=("a=/x", "b=/y"), max_loras=0)

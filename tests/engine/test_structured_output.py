"""Structured output in the engine: the output matches its JSON schema, JSON object, regex or choice
with either grammar library, also through preemptions; bad grammars are refused when the request
arrives, naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.sampling.structured import GRAMMAR_BACKENDS, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                     "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                   "name": {"type": "string", "maxLength": 6}},
    "required": ["colour", "n", "tags", "name"], "additionalProperties": False,
}


def _json_object_prefix(text: str) -> bool:
    """Whether ``text`` is the start of some JSON object: closed by what its open strings, literals,
    numbers, keys and brackets still need."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (not esc and ch == "\\"), in_str and (esc or ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    if not text.lstrip().startswith("{"):
        return False
    head = text + ('"' if in_str else "")
    closers = "".join(reversed(stack))
    for filler in ("", "0", "null", ":null", '"":null', "e", "ue", "rue", "se", "lse", "alse", "l", "ll", "ull"):
        for body in (head + filler, head.rstrip().rstrip(",") + filler):
            try:
                json.loads(body + closers)
                return True
            except ValueError:
                pass
    return False


def test_json_object_prefix_check():
    for good in ('{"a": [1, 2', '{"a": "x\\"y', '{"a": tr', '{"a":', '{"a', '{"a": 1,', '{', '{"a": -'):
        assert _json_object_prefix(good), good
    for bad in ('["a"]', '{"a": ]', '{"a" 1', 'x{'):
        assert not _json_object_prefix(bad), bad


def _llm(path, backend, **kw):
    return LLM(path, **{"dtype": "float32", "num_pages": 128, "calibrate_rho": False, "swap_space": 0,
                        "structured_output_backend": backend, **kw})


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_outputs_match_their_constraint(opt_tiny, backend):
    llm = _llm(opt_tiny, backend)
    prompts = ["Describe a thing", "Another", "A third prompt here"]

    def params(**spec):
        return SamplingParams(temperature=0.8, seed=1, max_tokens=80, structured_output=StructuredOutput(**spec))

    for out in llm.generate(prompts, params(json=SCHEMA)):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    for out in llm.generate(prompts, params(json_object=True)):
        # Keys are free strings: a random model may not close one within max_tokens; then what it wrote
        # must still be the start of a JSON object.
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert out.outputs[0].finish_reason == "length" and _json_object_prefix(text), text
    for out in llm.generate(prompts, params(regex=r"[0-9]{3}-[a-z]{2}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.outputs[0].text), out.outputs[0].text
    for out in llm.generate(prompts, params(choice=["yes", "no", "maybe so"])):
        assert out.outputs[0].text in ("yes", "no", "maybe so")
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))  # others unaffected
    assert all(len(o.outputs[0].token_ids) == 8 for o in free)


def test_grammar_state_survives_preemption_and_recompute(opt_tiny):
    # A pool too small for all of them at once: requests are preempted and recomputed mid-output.
    llm = _llm(opt_tiny, "llguidance", num_pages=24, policy="fcfs", max_num_seqs=16)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured_output=StructuredOutput(json=SCHEMA))
    outs = llm.generate([f"Item {i} " * 20 for i in range(12)], params)
    assert llm.cache_stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert llm.llm_engine.runner.sampler.structured._matchers == {}  # every matcher forgotten


def test_the_mask_and_penalties_are_measured_and_priced_into_apts_step_budget(opt_tiny):
    from apt_serve_ray.scheduler.candidates import Candidates
    from apt_serve_ray.scheduler.policies.apt.shape import sampling_extra_s
    from apt_serve_ray.scheduler.context import SchedulingContext

    llm = _llm(opt_tiny, "llguidance", policy="apt")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, structured_output=StructuredOutput(json=SCHEMA))
    llm.generate(["Describe a thing"], params)
    llm.generate(["Another"], SamplingParams(temperature=0, max_tokens=6, presence_penalty=0.5))
    sampler, policy = engine.runner.sampler, engine.scheduler.policy
    assert sampler.mask_s_per_row > 0 and sampler.adjust_s_per_row > 0
    assert policy.sampling_costs == (sampler.mask_s_per_row, sampler.adjust_s_per_row)
    # Two decoding rows, one constrained: the step's budget pays one mask (as planned extra seconds).
    engine.add_request("Describe", params)
    engine.add_request("Other", SamplingParams(max_tokens=4))
    engine.step()  # both prefilled: they decode from now on
    policy.sampling_costs = (0.01, 0.0)
    c = Candidates.gather(SchedulingContext(engine.scheduler, engine.clock()))
    rows = np.flatnonzero(c.is_decoding[:c.num_running])
    assert rows.size == 2 and sampling_extra_s(policy.sampling_costs, c, rows) == pytest.approx(0.01)


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_a_bad_grammar_is_refused_when_the_request_arrives(opt_tiny, backend):
    llm = _llm(opt_tiny, backend)
    for spec in ({"regex": "(unclosed"}, {"json": {"type": 7}}):
        with pytest.raises(ValueError, match="^structured_output:"):
            llm.llm_engine.add_request("x", SamplingParams(structured_output=StructuredOutput(**spec)))
    assert not llm.llm_engine.has_unfinished_requests()


def test_constraints_are_checked_when_made():
    for kwargs in ({}, {"json": {}, "regex": "a"}, {"json": "{not json"}, {"choice": []}, {"choice": ["", "x"]},
                   {"json": [1]}):
        with pytest.raises(ValueError, match="^structured_output:"):
            StructuredOutput(**kwargs)
    assert StructuredOutput(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutput(choice=["a.b"]).as_schema_or_regex() == (None, r"(a\.b)")

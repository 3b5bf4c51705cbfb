"""Run by tests/kernels/test_kernels.py with TRITON_INTERPRET=1: the engine on the Triton backend (paged KV
decode + fused hidden decode) gives the same tokens and near-equal logprobs as the PyTorch path."""

import sys

from apt_serve_ray import LLM, SamplingParams

path = sys.argv[1]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
prompts = [[11, 12, 13, 14, 15], [21] * 19, [31] * 9]
outs = {}
for backend in ("torch", "triton"):
    llm = LLM(path, dtype="float32", num_pages=32, cache_ratio=0.5, enable_watermarks=False, policy="sarathi",
              attention_backend=backend, calibrate_rho=False)
    assert llm.llm_engine.runner.attention.name == backend
    outs[backend] = llm.generate(prompts, params)
assert {o.metrics.cache_kind for o in outs["triton"]} == {"kv", "hidden"}
for a, b in zip(outs["torch"], outs["triton"]):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].token_ids, b.outputs[0].token_ids)
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert max(abs(la[t] - lb[t]) for t in set(la) & set(lb)) < 1e-4
print("engine kernel path matches")

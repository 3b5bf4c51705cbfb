"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: the engine with the fused hidden-decode kernel
forced on gives the same tokens and near-equal logprobs as the PyTorch path."""

import os
import sys

from apt_serve_ray import LLM, SamplingParams

path = sys.argv[1]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
prompts = [[11, 12, 13, 14, 15], [21] * 19]
outs = {}
for flag in ("0", "1"):
    os.environ["APT_HIDDEN_KERNEL"] = flag
    llm = LLM(path, dtype="float32", num_pages=32, cache_ratio=1.0, force_hidden=True, enable_watermarks=False)
    assert llm.llm_engine.runner.use_hidden_kernel == (flag == "1")
    outs[flag] = llm.generate(prompts, params)
for a, b in zip(outs["0"], outs["1"]):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].token_ids, b.outputs[0].token_ids)
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert max(abs(la[t] - lb[t]) for t in set(la) & set(lb)) < 1e-4
print("engine kernel path matches")

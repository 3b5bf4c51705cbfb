"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Greedy rows take one argmax for the whole batch. Sampled rows are filtered in a vectorised pass;
the draw itself is per row so that a seeded request gets the same tokens whatever batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apt_serve_ray.request import Request


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._generator
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._request_generators[request.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        logits = logits.float().cpu()
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            params = [requests[i].sampling_params for i in sampled_rows]
            probs = _filtered_probs(logits[rows], params)
            for j, i in enumerate(sampled_rows):
                token_ids[i] = torch.multinomial(probs[j], 1, generator=self._generator_for(requests[i]))[0]
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        out = [SampledToken(int(t)) for t in token_ids.tolist()]
        if want_logprobs:
            logp = torch.log_softmax(logits[want_logprobs], dim=-1)
            for j, i in enumerate(want_logprobs):
                tok = out[i].token_id
                out[i].logprob = float(logp[j, tok])
                k = requests[i].sampling_params.logprobs
                top = {}
                if k:
                    vals, ids = logp[j].topk(k)
                    top = dict(zip(ids.tolist(), vals.tolist()))
                top[tok] = out[i].logprob
                out[i].top_logprobs = top
        return out


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_ps = torch.tensor([p.top_p for p in params])
    if (top_ks < vocab).any() or (top_ps < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        drop = ranks >= top_ks.unsqueeze(1)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)

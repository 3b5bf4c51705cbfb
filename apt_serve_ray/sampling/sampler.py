"""Token sampling: logit bias and penalties, greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

Greedy rows take one argmax for the whole batch. Sampled rows are filtered in a vectorised pass and
drawn by inverse CDF: one uniform number per row (from the row's own generator where the request is
seeded, so it gets the same tokens whatever batch it is in), one cumulative sum and one search for
the batch. ``torch.multinomial`` (and the exponential race) draw a random number per vocabulary entry:
on an AVX2 CPU of these machines 1.7-1.9 ms per row of OPT's 50,272 tokens, which made sixteen
sampled requests cost 27 ms of a 38 ms decode step of a tiny model; the search costs ~0.1 ms a row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from apt_serve_ray.request import Request


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    grammar_done: bool = False  # the request's structured output is complete with this token


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.structured = None  # StructuredOutputs, set by the engine when a request first needs one
        # What a row costs beyond plain sampling, as measured here (moving averages, seconds a row):
        # a structured-output row's mask and matcher advance, a row's logit bias and penalties. The
        # engine hands them to the policy, which prices them into its step budget.
        self.mask_s_per_row = 0.0
        self.adjust_s_per_row = 0.0
        self._token_counts: dict[str, TokenCounts] = {}  # per penalised request, kept as it generates

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self._token_counts.pop(request_id, None)
        if self.structured is not None:
            self.structured.forget(request_id)

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
        logits = raw = logits.float().cpu()
        adjusted = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
        if adjusted:
            t0 = time.perf_counter()
            logits = raw.clone()
            apply_penalties_batch(logits, adjusted, requests, self._token_counts)
            self.adjust_s_per_row = _ewma(self.adjust_s_per_row, (time.perf_counter() - t0) / len(adjusted))
        constrained: list[int] = []
        mask_s = 0.0
        if self.structured is not None:
            ids = [r.request_id for r in requests]
            if any(rid in self.structured for rid in ids):
                t0 = time.perf_counter()
                logits = logits.clone() if logits is raw else logits
                constrained = self.structured.mask(logits, ids)
                mask_s = time.perf_counter() - t0
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            params = [requests[i].sampling_params for i in sampled_rows]
            probs = _filtered_probs(logits[rows], params)
            u = torch.empty(len(sampled_rows), dtype=torch.float64)
            for j, i in enumerate(sampled_rows):
                u[j] = torch.rand((), dtype=torch.float64, generator=self._generator_for(requests[i]))
            token_ids[rows] = draw(probs, u)
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        out = [SampledToken(int(t)) for t in token_ids.tolist()]
        if constrained:
            t0 = time.perf_counter()
            for i in constrained:
                out[i].grammar_done = self.structured.accept(requests[i].request_id, out[i].token_id)
            mask_s += time.perf_counter() - t0
            self.mask_s_per_row = _ewma(self.mask_s_per_row, mask_s / len(constrained))
        if want_logprobs:
            logp = torch.log_softmax(raw[want_logprobs], dim=-1)
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


def _ewma(average: float, sample: float, rate: float = 0.1) -> float:
    return sample if average == 0.0 else average + rate * (sample - average)


class TokenCounts:
    """One request's distinct tokens for its penalties, kept up to date as it generates: each output id
    and how often it occurs (presence, frequency), and every id of its prompt or output (repetition),
    as index tensors. The penalties touch only those ids: passes over the whole vocabulary cost
    ~0.2-0.4 ms a row of 49,152 tokens, and rebuilding the lists every step as much again. Ids past the
    vocabulary are ignored."""

    def __init__(self, request: Request, vocab: int) -> None:
        self.vocab = vocab
        self._output: dict[int, int] = {}
        self._seen = {t for t in request.prompt_token_ids if t < vocab}
        self.num_output = 0
        self.output_ids = self.output_counts = self.seen_ids = None

    def update(self, request: Request) -> "TokenCounts":
        new = request.output_token_ids[self.num_output:]
        if new or self.seen_ids is None:
            for t in new:
                if t < self.vocab:
                    self._output[t] = self._output.get(t, 0) + 1
                    self._seen.add(t)
            self.num_output = len(request.output_token_ids)
            self.output_ids = torch.tensor(list(self._output), dtype=torch.long)
            self.output_counts = torch.tensor(list(self._output.values()), dtype=torch.float32)
            self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        return self


def apply_penalties_batch(logits: torch.Tensor, rows: list[int], requests: list[Request],
                          counts: dict[str, TokenCounts] | None = None) -> None:
    """``apply_penalties`` for the ``rows`` of ``logits`` [N, V] at once, in place, touching only the
    ids each request has seen (``TokenCounts``, kept in ``counts`` by request id across steps; None:
    counted now): the biases, then presence and frequency over the output, then repetition over prompt
    and output, each one indexed pass over all the rows."""
    vocab = logits.shape[1]
    flat = logits.view(-1)
    bias_at, bias_by, pf_at, pf_by, rep_at, rep_by = [], [], [], [], [], []
    counts = {} if counts is None else counts
    for i in rows:
        r = requests[i]
        sp = r.sampling_params
        base = i * vocab
        if sp.logit_bias:
            ids = [t for t in sp.logit_bias if t < vocab]
            bias_at += [base + t for t in ids]
            bias_by += [sp.logit_bias[t] for t in ids]
        pf = (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids
        if pf or sp.repetition_penalty != 1.0:
            c = counts.get(r.request_id)
            if c is None or c.vocab != vocab:
                c = counts[r.request_id] = TokenCounts(r, vocab)
            c.update(r)
            if pf:
                pf_at.append(c.output_ids + base)
                pf_by.append(sp.frequency_penalty * c.output_counts + sp.presence_penalty)
            if sp.repetition_penalty != 1.0:
                rep_at.append(c.seen_ids + base)
                rep_by.append(torch.full((c.seen_ids.numel(),), float(sp.repetition_penalty)))
    if bias_at:
        flat.index_add_(0, torch.tensor(bias_at, dtype=torch.long), torch.tensor(bias_by, dtype=flat.dtype))
    if pf_at:
        flat.index_add_(0, torch.cat(pf_at), -torch.cat(pf_by).to(flat.dtype))
    if rep_at:
        at, by = torch.cat(rep_at), torch.cat(rep_by).to(flat.dtype)
        v = flat[at]
        flat[at] = torch.where(v > 0, v / by, v * by)


def apply_penalties(row: torch.Tensor, request: Request) -> None:
    """One request's logits [V], in place: its logit bias, then the presence, frequency and repetition
    penalties over what it has generated (repetition: and its prompt). Token ids past the vocabulary
    (a bias for the tokenizer's added tokens the model lacks) are ignored. The reference of
    ``apply_penalties_batch``, which the sampler runs."""
    sp, vocab = request.sampling_params, row.shape[0]
    if sp.logit_bias:
        ids = [t for t in sp.logit_bias if t < vocab]
        if ids:
            row[torch.tensor(ids)] += torch.tensor([sp.logit_bias[t] for t in ids])
    outputs = request.output_token_ids
    if outputs and (sp.presence_penalty or sp.frequency_penalty):
        counts = torch.bincount(torch.tensor(outputs), minlength=vocab)[:vocab].float()
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    if sp.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor(request.all_token_ids)
        seen[ids[ids < vocab]] = True
        penalised = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [n, V] (rows need not sum to exactly 1) by inverse CDF, given
    uniform numbers ``u`` [n] in [0, 1): the first token whose cumulative mass exceeds ``u`` times the
    row's total. A token of probability 0 is never drawn (its cumulative mass equals its predecessor's)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    token = torch.searchsorted(cdf, u.double().unsqueeze(1) * total, right=True)
    # u * total rounds up to total only for u within an ulp of 1: then the last token with mass.
    return torch.minimum(token, torch.searchsorted(cdf, total)).squeeze(1)


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_ps = torch.tensor([p.top_p for p in params])
    min_ps = torch.tensor([p.min_p for p in params])
    if (min_ps > 0).any():  # less likely than min_p x the likeliest token: out
        probs = logits.softmax(dim=-1)
        floor = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
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

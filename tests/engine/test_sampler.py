"""The sampler's draw: inverse CDF over the filtered probabilities, one uniform number per row."""

from __future__ import annotations

import torch

from apt_serve_ray.sampling.sampler import draw


def test_draws_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 0.0, 2.0]])  # rows need not sum to 1
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    tokens = torch.stack([draw(probs, torch.rand(2, dtype=torch.float64, generator=gen)) for _ in range(n)])
    freq = torch.bincount(tokens[:, 0], minlength=4).double() / n
    # 4 standard deviations of a binomial share at n = 40,000 is under 0.01.
    assert torch.allclose(freq, torch.tensor([0.5, 0.0, 0.2, 0.3], dtype=torch.float64), atol=0.01), freq
    assert freq[1] == 0  # probability 0: never drawn
    assert torch.all(tokens[:, 1] == 3)


def test_draw_at_the_ends_of_the_unit_interval_stays_on_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0]])
    assert draw(probs, torch.tensor([0.0])).item() == 1
    assert draw(probs, torch.tensor([1.0 - 1e-16], dtype=torch.float64)).item() == 2
    assert draw(probs, torch.tensor([0.2499])).item() == 1 and draw(probs, torch.tensor([0.2501])).item() == 2


def test_sampling_a_full_vocabulary_matches_multinomial_in_distribution():
    gen = torch.Generator().manual_seed(1)
    probs = torch.randn(1, 1000, generator=gen).mul(3).softmax(-1)
    n = 20_000
    ours = draw(probs.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=gen))
    ref = torch.multinomial(probs[0], n, replacement=True, generator=gen)
    # Compare the mass of the 10 likeliest tokens and the rest, drawn both ways.
    top = probs[0].topk(10).indices
    for sample in (ours, ref):
        share = torch.isin(sample, top).double().mean()
        assert abs(share - probs[0, top].sum().double()) < 0.015


def test_a_uniform_number_that_rounds_up_to_the_total_still_lands_on_a_token_with_mass():
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]])
    assert draw(probs, torch.tensor([1.0])).item() == 2


# Logit adjustments: bias and penalties (OpenAI's and vLLM's definitions), min-p ---------------------
def _request(prompt, outputs, **params):
    from apt_serve_ray import SamplingParams
    from apt_serve_ray.request import Request

    r = Request("r", list(prompt), SamplingParams(**params), max_total_tokens=1000, ttft_slo_ms=1e3, tbt_slo_ms=1e3)
    for t in outputs:
        r.output_token_ids.append(t)
        r.all_token_ids.append(t)
    return r


def test_penalties_and_bias_follow_their_definitions():
    from apt_serve_ray.sampling.sampler import apply_penalties

    logits = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    r = _request([0, 1], [2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                 logit_bias={4: 10.0, 5: -100.0})
    row = logits.clone()
    apply_penalties(row, r)
    counts = torch.tensor([0, 0, 2, 1, 0, 0.0])
    expected = logits + torch.tensor([0, 0, 0, 0, 10.0, -100.0])  # bias first
    expected = expected - 0.25 * counts - 0.5 * (counts > 0).float()  # output tokens only
    seen = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)  # prompt and output: repetition
    expected = torch.where(seen, torch.where(expected > 0, expected / 2.0, expected * 2.0), expected)
    torch.testing.assert_close(row, expected)


def test_the_batched_penalties_are_the_row_by_row_reference():
    from apt_serve_ray.sampling.sampler import apply_penalties, apply_penalties_batch

    g = torch.Generator().manual_seed(0)
    vocab = 50
    settings = [dict(presence_penalty=0.5, frequency_penalty=0.25), dict(repetition_penalty=1.5),
                dict(logit_bias={3: 2.0, 60: 1.0}), dict(presence_penalty=-1.0, repetition_penalty=0.8,
                                                         logit_bias={7: -5.0}), {}]
    requests = [_request(torch.randint(0, vocab, (9,), generator=g).tolist(),
                         torch.randint(0, vocab, (7,), generator=g).tolist() if i != 2 else [], **kw)
                for i, kw in enumerate(settings)]
    for i, r in enumerate(requests):
        r.request_id = f"r{i}"  # the sampler keeps each request's counts by its id
    requests[1].all_token_ids.append(70)  # past the vocabulary (a tokenizer's added token): ignored
    requests[1].output_token_ids.append(70)
    logits = torch.randn(len(requests), vocab, generator=g)
    batched = logits.clone()
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    apply_penalties_batch(batched, rows, requests)
    for i, r in enumerate(requests):
        row = logits[i].clone()
        if i in rows:
            apply_penalties(row, r)
        torch.testing.assert_close(batched[i], row)
    # Kept across steps: a request generates one more token, and only that is counted anew.
    counts = {}
    apply_penalties_batch(logits.clone(), rows, requests, counts)
    requests[0].output_token_ids.append(5)
    requests[0].all_token_ids.append(5)
    again = logits.clone()
    apply_penalties_batch(again, rows, requests, counts)
    row = logits[0].clone()
    apply_penalties(row, requests[0])
    torch.testing.assert_close(again[0], row)


def test_greedy_sees_the_adjusted_logits_and_logprobs_the_models():
    from apt_serve_ray.sampling.sampler import Sampler

    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    plain = _request([0], [], temperature=0, logprobs=1)
    biased = _request([0], [], temperature=0, logprobs=1, logit_bias={1: -100.0})
    out = Sampler(0).sample(logits.repeat(2, 1), [plain, biased])
    assert out[0].token_id == 1 and out[1].token_id == 2
    model = torch.log_softmax(logits[0], -1)
    assert abs(out[1].logprob - float(model[2])) < 1e-6  # the model's distribution, before the bias


def test_min_p_keeps_only_tokens_near_the_likeliest():
    from apt_serve_ray.sampling.sampler import _filtered_probs
    from apt_serve_ray import SamplingParams

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filtered_probs(logits, [SamplingParams(min_p=0.5)])  # floor 0.25
    assert torch.equal(probs[0] > 0, torch.tensor([True, True, False, False]))
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))


def test_bad_adjustments_are_refused_naming_the_field():
    import pytest

    from apt_serve_ray import SamplingParams

    for kwargs, field in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "x"},
                          "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"min_p": 1.5}, "min_p"), ({"logit_bias": {"-3": 1}}, "logit_bias"),
                          ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"7": -1}).logit_bias == {7: -1.0}

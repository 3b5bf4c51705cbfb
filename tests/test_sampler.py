"""The sampler's draw: inverse CDF over the filtered probabilities, one uniform number per row."""

from __future__ import annotations

import torch

from apt_serve_ray.sampler import draw


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

"""The sampler draws from the distribution it states: frequencies over many draws match
softmax(logits / temperature) after top-k, top-p and min-p, a token of probability 0 is never
drawn, and a seeded row draws the same token wherever it sits in the batch."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.sampler import Sampler
from inflight.request import Request, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5])


def draw(params: SamplingParams, num_draws: int = 40_000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """How often each token was drawn, as a share of `num_draws` (one batch of that many rows)."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    requests = [Request(f"r{i}", [1], params) for i in range(num_draws)]
    tokens = sampler(logits.expand(num_draws, -1).contiguous(), requests)
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).double() / num_draws


def expected(temperature: float = 1.0, keep: torch.Tensor | None = None) -> torch.Tensor:
    p = (LOGITS.double() / temperature).softmax(dim=0)
    if keep is not None:
        p = torch.where(keep, p, 0.0)
    return p / p.sum()


def assert_matches(freq: torch.Tensor, p: torch.Tensor, num_draws: int = 40_000) -> None:
    # Each frequency within 5 standard deviations of its probability; zero stays zero.
    sigma = (p * (1 - p) / num_draws).sqrt()
    assert bool(((freq - p).abs() <= 5 * sigma + 1e-12).all()), (freq, p)
    assert bool((freq[p == 0] == 0).all())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature: float) -> None:
    assert_matches(draw(SamplingParams(temperature=temperature)), expected(temperature))


def test_top_k_top_p_and_min_p_cut_the_distribution_then_renormalise() -> None:
    p = expected()
    order = p.argsort(descending=True)
    top3 = torch.zeros(len(p), dtype=torch.bool)
    top3[order[:3]] = True
    assert_matches(draw(SamplingParams(top_k=3)), expected(keep=top3))
    # top_p 0.6: keep the most likely tokens until they reach 0.6 (the first always stays).
    mass = p[order].cumsum(0) - p[order]
    nucleus = torch.zeros(len(p), dtype=torch.bool)
    nucleus[order[mass < 0.6]] = True
    assert_matches(draw(SamplingParams(top_p=0.6)), expected(keep=nucleus))
    assert_matches(draw(SamplingParams(min_p=0.3)), expected(keep=p >= 0.3 * p.max()))


@pytest.mark.parametrize("params", [{"top_p": 1e-300}, {"top_p": 1e-300, "min_p": 1.0}, {"top_k": 1},
                                    {"min_p": 1.0}, {"temperature": 1e-6}, {"temperature": 5e-324}],
                         ids=["top_p-0-in-fp32", "and-min_p-1", "top_k-1", "min_p-1", "temperature-1e-6",
                              "temperature-0-in-fp32"])
def test_the_narrowest_settings_keep_the_most_likely_token(params: dict[str, float]) -> None:
    """Values at the edge of their range (some round to 0 in fp32) leave the most likely token,
    not an empty distribution whose draw lands anywhere."""
    assert draw(SamplingParams(**params), 1000)[int(LOGITS.argmax())] == 1.0


def test_a_single_possible_token_is_always_drawn() -> None:
    logits = torch.full((8,), float("-inf"))
    logits[6] = 0.0
    assert draw(SamplingParams(temperature=1.0), 1000, logits)[6] == 1.0


def test_a_seeded_row_draws_the_same_token_wherever_it_sits() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=42))
    others = [Request(f"o{i}", [1], SamplingParams(temperature=1.0 if i % 2 else 0)) for i in range(5)]
    alone = sampler(logits[:1], [seeded])[0]
    for position in range(6):
        batch = others[:position] + [seeded] + others[position:]
        rows = torch.cat([logits[1:position + 1], logits[:1], logits[position + 1:]])
        assert sampler(rows, batch)[position] == alone


def test_the_nucleus_found_among_candidates_is_the_full_sorts() -> None:
    # Peaked rows take the fast path (their nucleus lies among the 256 most likely tokens), flat
    # ones the full sort; both must keep exactly the tokens the full sort keeps.
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(4, 5000, generator=g) * 8
    flat = torch.randn(4, 5000, generator=g) * 0.5
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99] * 2)
    fast = Sampler._apply_top_p(logits, top_p)
    exact = Sampler._nucleus_by_sort(logits, top_p)
    assert torch.equal(fast.isfinite(), exact.isfinite())
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])
    kept = fast.isfinite().sum(dim=1)
    assert bool((kept[:4] < 256).all()) and bool((kept[4:] > 256).all())  # both paths were taken

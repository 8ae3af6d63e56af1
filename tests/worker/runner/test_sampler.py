"""Sampler: greedy, filters, seeds, logprobs; SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from worker.runner.sampler import Sampler, make_generator
from worker.sampling_params import SamplingParams

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = PROBS.log()


def _draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    gen = make_generator(params)
    return [Sampler().sample(logits[None], [params], [gen]).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax_with_logprob() -> None:
    """temperature 0 picks the argmax of every row; its logprob is the log-softmax value."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(out.logprobs), want)
    assert out.top_logprobs == [[]] * 6


def test_top_k_restricts_support() -> None:
    """top_k=2 only ever yields the two most likely tokens, and both occur."""
    seen = set(_draw(SamplingParams(top_k=2, seed=1), 200))
    assert seen == {0, 1}


@pytest.mark.parametrize("top_p,support", [(0.4, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2})])
def test_top_p_keeps_the_smallest_covering_set(top_p: float, support: set[int]) -> None:
    """top_p keeps tokens until their mass reaches p (the first one always)."""
    assert set(_draw(SamplingParams(top_p=top_p, seed=2), 300)) == support


def test_min_p_drops_unlikely_tokens() -> None:
    """min_p=0.3 drops tokens below 0.3 x the top probability (0.15): only 0 and 1 remain."""
    assert set(_draw(SamplingParams(min_p=0.3, seed=3), 300)) == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    """Frequencies over 4000 draws are within 4 sigma of the softmax probabilities."""
    n = 4000
    params = [SamplingParams(seed=4)] * 1
    gen = make_generator(params[0])
    draws = torch.tensor(
        [Sampler().sample(LOGITS[None], params, [gen]).token_ids[0] for _ in range(n)]
    )
    freq = torch.bincount(draws, minlength=5).float() / n
    sigma = (PROBS * (1 - PROBS) / n).sqrt()
    assert ((freq - PROBS).abs() < 4 * sigma).all(), freq


def test_low_temperature_sharpens() -> None:
    """temperature 0.05 on these logits is effectively greedy."""
    assert set(_draw(SamplingParams(temperature=0.05, seed=5), 100)) == {0}


def test_seed_reproducible_regardless_of_batch() -> None:
    """A seeded request draws the same tokens alone or at another row of a bigger batch."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(6))
    seeded = SamplingParams(temperature=1.5, seed=1234)
    alone_gen = make_generator(seeded)
    alone = [Sampler().sample(logits[1:2], [seeded], [alone_gen]).token_ids[0] for _ in range(20)]
    batch_gen = make_generator(seeded)
    other = SamplingParams(temperature=1.0)
    mixed = []
    for _ in range(20):
        out = Sampler().sample(
            logits, [other, seeded, SamplingParams(temperature=0.0)], [None, batch_gen, None]
        )
        mixed.append(out.token_ids[1])
    assert alone == mixed
    assert len(set(alone)) > 3, "temperature 1.5 over 100 tokens should vary"


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    a = _draw(SamplingParams(seed=1), 10, logits[0])
    b = _draw(SamplingParams(seed=2), 10, logits[0])
    assert a != b


def test_top_logprobs_sorted_and_consistent() -> None:
    """logprobs=n returns n (token, logprob) pairs, best first; the chosen token's value agrees."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=9, logprobs=None)]
    out = Sampler().sample(logits, params, [None, make_generator(params[1])])
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 3
    assert [t for t, _ in top] == torch.topk(logits[0], 3).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert top[0] == (out.token_ids[0], pytest.approx(out.logprobs[0]))
    assert math.isclose(
        sum(math.exp(lp) for lp in torch.log_softmax(logits[0], -1).tolist()), 1.0, rel_tol=1e-5
    )
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_row_count_must_match() -> None:
    with pytest.raises(ValueError, match="2 logits rows for 1"):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()])


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_validate_names_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs).validate()


def test_defaults_validate_and_lists_become_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    p.validate()
    assert p.stop == ("a", "b") and p.stop_token_ids == (3,)
    assert SamplingParams(stop="x").stop == ("x",)
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,)))

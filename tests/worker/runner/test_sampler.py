"""Sampler: logit controls, greedy, filters, seeds, logprobs; SamplingParams validation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from core.sampling_params import SamplingParams
from worker.runner.noise import seed_key
from worker.runner.sampler import Sampler, SampleRow

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = PROBS.log()


def _rows(params: Sequence[SamplingParams], step: int = 0, **kw: object) -> list[SampleRow]:
    return [SampleRow(p, seed_key(p.seed if p.seed is not None else 0), step, **kw) for p in params]  # type: ignore[arg-type]


def _draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    return [Sampler().sample(logits[None], _rows([params], step)).token_ids[0] for step in range(n)]


def test_greedy_is_argmax_with_logprob() -> None:
    """temperature 0 picks the argmax of every row; its logprob is the log-softmax value."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, _rows([SamplingParams(temperature=0.0, logprobs=0)] * 6))
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
    draws = torch.tensor(_draw(SamplingParams(seed=4), n))
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
    alone = [Sampler().sample(logits[1:2], _rows([seeded], t)).token_ids[0] for t in range(20)]
    other = SamplingParams(temperature=1.0, seed=77)
    mixed = []
    for t in range(20):
        rows = _rows([other, seeded, SamplingParams(temperature=0.0)], t)
        mixed.append(Sampler().sample(logits, rows).token_ids[1])
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
    out = Sampler().sample(logits, _rows(params))
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
    with pytest.raises(ValueError, match="2 logits rows for 1 sampling rows"):
        Sampler().sample(torch.zeros(2, 5), _rows([SamplingParams()]))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
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


def test_seeds_beyond_32_and_64_bits_stay_distinct() -> None:
    """Seeds that agree in their low 32 (or 64) bits draw different tokens; a seed repeats."""
    logits = torch.zeros(1, 1000)
    seeds = [1, 2**32 + 1, 2**63 + 1, 2**64 + 1, -1, 10**40]
    draws = [tuple(_draw(SamplingParams(seed=s), 8, logits[0])) for s in seeds]
    assert len(set(draws)) == len(seeds)
    assert tuple(_draw(SamplingParams(seed=10**40), 8, logits[0])) == draws[-1]


def test_logit_bias_and_banned_tokens() -> None:
    """A +100 bias makes a token the greedy pick; a banned token is never picked."""
    greedy = SamplingParams(temperature=0.0, logit_bias=((3, 100.0),))
    assert Sampler().sample(LOGITS[None], _rows([greedy])).token_ids == [3]
    banned = _rows([SamplingParams(temperature=0.0)], banned=(0,))
    assert Sampler().sample(LOGITS[None], banned).token_ids == [1]


def test_a_request_s_bias_and_bans_become_tensors_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 logit_bias entries and 500 banned ids become tensors on a request's first step;
    later steps hand torch a few numbers (rows, counts), not every entry again, and sample the
    same as a fresh sampler."""
    params = SamplingParams(temperature=0.0, logit_bias=[(t, 1.0 + t / 1000) for t in range(1000)])
    rows = [SampleRow(params, 0, 0, banned=frozenset(range(1000, 1500)))]
    logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(0))
    want = Sampler().sample(logits, rows).token_ids
    sampler, handed = Sampler(), []
    real = torch.tensor

    def spy(data: object, *args: object, **kw: object) -> torch.Tensor:
        handed.append(len(data) if isinstance(data, (list, tuple)) else 1)
        return real(data, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "tensor", spy)
    per_step = []
    for _ in range(3):
        handed.clear()
        assert sampler.sample(logits, rows).token_ids == want
        per_step.append(sum(handed))
    assert per_step[0] >= 1500 and max(per_step[1:]) <= 8, per_step


def test_banned_until_min_tokens_is_one_set_per_request() -> None:
    """EOS plus the stop ids, built once: every step gets the same set object."""
    params, eos = SamplingParams(stop_token_ids=[9, 4, 9]), frozenset({2})
    first = params.banned_until_min_tokens(eos)
    assert first == {2, 4, 9} and params.banned_until_min_tokens(eos) is first
    assert params.stop_token_set == {4, 9} and SamplingParams(stop=["ab", "abcd"]).longest_stop == 4


def test_penalties_push_away_seen_tokens() -> None:
    """Frequency/presence penalties lower generated tokens; repetition also covers the prompt."""
    logits = torch.tensor([[2.0, 1.9, 1.0, -1.0]])
    freq = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert Sampler().sample(logits, _rows([freq], output_ids=[0])).token_ids == [1]
    pres = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert Sampler().sample(logits, _rows([pres], output_ids=[0, 1])).token_ids == [2]
    rep = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    assert Sampler().sample(logits, _rows([rep], prompt_ids=[0], output_ids=[1])).token_ids == [2]


def test_bitmask_limits_choices_per_row() -> None:
    """Rows marked masked pick only allowed tokens; other rows ignore the bitmask."""
    logits = LOGITS[None].repeat(2, 1)
    bitmask = torch.tensor([[0b10100], [0]], dtype=torch.int32)  # row 0: tokens 2 and 4
    rows = [SampleRow(SamplingParams(temperature=0.0), 0, 0, masked=True),
            SampleRow(SamplingParams(temperature=0.0), 0, 0)]  # fmt: skip
    assert Sampler().sample(logits, rows, bitmask).token_ids == [2, 0]
    sampled = {Sampler().sample(logits[:1], [SampleRow(SamplingParams(), 5, t, masked=True)],
                                bitmask[:1]).token_ids[0] for t in range(60)}  # fmt: skip
    assert sampled == {2, 4}


def test_noise_is_positive_at_the_top_draw() -> None:
    """Seed 3031's first draw for token 467 is the top 24-bit value, whose float32 uniform
    rounded to exactly 1.0 (E = -0.0); every draw stays strictly positive and finite."""
    from worker.runner.noise import _GOLDEN, _mix, _shr, _signed, exponential_noise

    key = seed_key(3031)
    row = _mix(torch.tensor([key]) ^ _mix(torch.tensor([0]) + _signed(_GOLDEN)))
    bits = _shr(_mix(row + torch.tensor([467]) * _signed(_GOLDEN)), 40)  # as the column of token 467
    assert int(bits) == 2**24 - 1  # the edge this test is about
    noise = exponential_noise([key], [0], 512, torch.device("cpu"))
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def test_masked_and_filtered_rows_never_take_an_excluded_token_at_the_top_draw() -> None:
    """At that draw token 467 has probability 0 (masked, or cut by top-k): 0 / E must not win."""
    logits = torch.zeros(1, 512)
    logits[0, 5] = 1.0
    only_5 = torch.zeros(1, 16, dtype=torch.int32)
    only_5[0, 0] = 1 << 5
    params = SamplingParams(seed=3031)
    masked = Sampler().sample(logits, [SampleRow(params, seed_key(3031), 0, masked=True)], only_5)
    assert masked.token_ids == [5] and masked.unsampled == ()
    top1 = Sampler().sample(logits, _rows([SamplingParams(seed=3031, top_k=1)]))
    assert top1.token_ids == [5]


def test_a_row_with_nothing_left_to_sample_is_reported() -> None:
    """A row whose allowed tokens all have -inf logits (or NaN logits) yields no token; the
    other rows sample as usual."""
    logits = LOGITS[None].repeat(3, 1).clone()
    logits[1, 2] = float("-inf")  # the only token row 1's mask allows
    logits[2] = float("nan")
    bitmask = torch.tensor([[-1], [0b100], [-1]], dtype=torch.int32)
    rows = [SampleRow(SamplingParams(temperature=t), 7, 0, masked=True) for t in (0.0, 1.0, 0.0)]
    out = Sampler().sample(logits, rows, bitmask)
    assert out.unsampled == (1, 2) and out.token_ids[0] == 0

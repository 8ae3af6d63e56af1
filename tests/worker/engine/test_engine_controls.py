"""Logit controls through the engine on the built-in tiny model: penalties change greedy
output the way they should, min_tokens holds EOS back, logit_bias steers, a seeded request
samples the same tokens alone and in a mixed batch, and a stop string costs one decode a token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine.engine import Engine

PROMPT = [17, 230, 45, 99, 512, 8, 77]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(model="tiny", max_total_tokens=4096))


def _tokens(engine: Engine, **kw: object) -> list[int]:
    return engine.generate([PROMPT], SamplingParams(temperature=0.0, ignore_eos=True, **kw))[0].token_ids  # type: ignore[arg-type]


def test_penalties_reduce_repetition(engine: Engine) -> None:
    """Greedy output repeats less with a presence, frequency or repetition penalty."""
    plain = len(set(_tokens(engine, max_tokens=40)))
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert len(set(_tokens(engine, max_tokens=40, **kw))) > plain, kw


def test_min_tokens_holds_eos_and_bias_steers(engine: Engine) -> None:
    """With EOS biased up by 100, the output is EOS at once, or after exactly min_tokens."""
    eos = next(iter(engine.stopper.eos))
    bias = ((eos, 100.0),)
    now = engine.generate([PROMPT], SamplingParams(max_tokens=10, logit_bias=bias))[0]
    held = engine.generate([PROMPT], SamplingParams(max_tokens=10, logit_bias=bias, min_tokens=4))[0]
    assert now.token_ids == [eos] and now.finish_reason == "stop"
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:4]


def test_seeded_request_alone_and_in_a_batch(engine: Engine) -> None:
    """A seed (here > 2**64) draws the same tokens alone and among other requests."""
    seeded = SamplingParams(max_tokens=12, seed=2**70 + 5, temperature=1.0, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0), SamplingParams(max_tokens=5, temperature=0.0)]
    mixed = engine.generate([PROMPT[:3], PROMPT, PROMPT[2:]], [others[0], seeded, others[1]])[1].token_ids
    assert alone == mixed


def test_a_stop_string_that_never_appears_costs_one_decode_per_token(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new token's stop-string check decodes one window as long as the longest stop
    string (+1 token); the window without the new token is decoded only when a stop string is
    in the window."""
    tok = engine.stopper._get_tokenizer()
    assert tok is not None
    windows: list[int] = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: windows.append(len(ids)) or real(ids, **kw))
    stop = "\x00never"
    out = _tokens(engine, max_tokens=20, stop=[stop])
    assert len(out) == 20
    assert len(windows) == 20 and max(windows) == len(stop) + 1

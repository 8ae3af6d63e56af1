"""A bad request fails alone: when a part of the step that only one request needs raises (its
prompt logprobs, its sampling row, its grammar mask or token check, its stop check, its
consumer), that request ends (`abort`, an error naming what failed) and every other request in
the same steps finishes with the tokens it gets without the bad one; the engine goes on serving.
A failure of the forward itself is not one request's: the step fails, as before.

Each test makes one stage raise for one request (a monkeypatched per-request function), with
`check_integrity()` after every step, overlap scheduling off and on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from core.outputs import StreamDelta
from core.sampling_params import Grammar, SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.config import EngineConfig
from worker.engine.engine import CONSUMER_FAILED, TOKEN_CHECK_FAILED, Engine
from worker.runner import model_runner, sampler
from worker.runner.logit_controls import RequestTensors
from worker.scheduler.request import Req

pytestmark = pytest.mark.usefixtures("overlap")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [tokens(30, seed=1), tokens(75, seed=2), tokens(12, seed=3)]  # 75 > one 64-token chunk


@dataclass
class Streams:
    """Every request's deltas, by request id."""

    deltas: dict[str, list[StreamDelta]] = field(default_factory=dict)

    def sink(self, delta: StreamDelta) -> None:
        self.deltas.setdefault(delta.request_id, []).append(delta)

    def tokens(self, rid: str) -> list[int]:
        return [t for d in self.deltas[rid] for t in d.token_ids]

    def last(self, rid: str) -> StreamDelta:
        return self.deltas[rid][-1]


def _run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> Streams:
    streams = Streams()
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, rid, streams.sink)
    run_checked(engine)
    return streams


def _failed_alone(streams: Streams, bad: str, error: str) -> None:
    last = streams.last(bad)
    assert last.finished and last.finish_reason == "abort" and last.error == error, last


def _still_serves(engine: Engine, oracle: Oracle) -> None:
    """After the failure the engine serves a new request, and its pools are whole."""
    out = engine.generate([PROMPTS[2]], GREEDY)[0]
    assert out.token_ids == oracle.greedy(PROMPTS[2], 6)
    assert_all_free(engine)


def _raising_for(fn: Callable[..., Any], bad: Callable[..., bool]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if bad(*args, **kwargs):
            raise RuntimeError("injected failure")
        return fn(*args, **kwargs)

    return wrapped


def test_a_stop_check_that_raises_ends_only_its_request(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop check (stop strings decode text) raises for one request id mid-decode."""
    engine = oracle.engine()
    check = engine.stopper.check
    monkeypatch.setattr(
        engine.stopper, "check", _raising_for(check, lambda req: req.rid == "bad" and len(req.output) == 3)
    )
    streams = _run(engine, [("a", PROMPTS[0], GREEDY), ("bad", PROMPTS[1], GREEDY), ("c", PROMPTS[2], GREEDY)])
    _failed_alone(streams, "bad", TOKEN_CHECK_FAILED)
    assert streams.tokens("bad") == oracle.greedy(PROMPTS[1], 3)  # what it had when it failed
    for rid, prompt in (("a", PROMPTS[0]), ("c", PROMPTS[2])):
        assert streams.tokens(rid) == oracle.greedy(prompt, 6) and streams.last(rid).error is None
    _still_serves(engine, oracle)


def test_prompt_logprobs_that_fail_end_only_their_request(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning one request's prompt rows into logprobs raises (its second chunk, in the
    runner); another request's prompt logprobs in the same steps are whole."""
    engine = oracle.engine()
    bad_ids = tuple(PROMPTS[1][65:70])  # inside the second chunk's rows

    def bad(logits: torch.Tensor, next_ids: tuple[int, ...], top_n: int) -> bool:
        return any(next_ids[i : i + 5] == bad_ids for i in range(len(next_ids)))

    monkeypatch.setattr(model_runner, "token_logprobs", _raising_for(model_runner.token_logprobs, bad))
    wants = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    streams = _run(engine, [("a", PROMPTS[0], wants), ("bad", PROMPTS[1], wants), ("c", PROMPTS[2], GREEDY)])
    _failed_alone(streams, "bad", model_runner.PROMPT_LOGPROBS_FAILED)
    assert streams.tokens("bad") == []
    alone = engine.generate([PROMPTS[0]], wants)[0]
    got = next(d.prompt_logprobs for d in streams.deltas["a"] if d.prompt_logprobs is not None)
    assert alone.prompt_logprobs is not None and len(got) == len(alone.prompt_logprobs) == len(PROMPTS[0])
    for x, y in zip(got[1:], alone.prompt_logprobs[1:]):  # the same up to the batch's rounding
        assert x is not None and y is not None and x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-4 and [t for t, _ in x.top] == [t for t, _ in y.top]
    assert streams.tokens("a") == oracle.greedy(PROMPTS[0], 6)
    assert streams.tokens("c") == oracle.greedy(PROMPTS[2], 6)
    _still_serves(engine, oracle)


def test_a_sampling_row_that_raises_fails_alone_not_the_batch(
    oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request's logit_bias tensors raise inside the batched sampler: that row fails, every
    other row (another biased one, a seeded one) gets the token it gets alone."""
    engine = oracle.engine()
    poison = ((7, 1.0),)
    monkeypatch.setattr(
        RequestTensors, "bias",
        _raising_for(RequestTensors.bias, lambda self, params, vocab: params.logit_bias == poison),
    )  # fmt: skip
    biased = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((9, 5.0),))
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=poison)
    streams = _run(engine, [("a", PROMPTS[0], biased), ("bad", PROMPTS[2], bad), ("c", PROMPTS[1], seeded)])
    _failed_alone(streams, "bad", sampler.SAMPLING_FAILED)
    want = engine.generate([PROMPTS[0], PROMPTS[1]], [biased, seeded])
    assert [streams.tokens("a"), streams.tokens("c")] == [o.token_ids for o in want]
    _still_serves(engine, oracle)


def test_a_consumer_that_raises_ends_only_its_request(oracle: Oracle) -> None:
    """A request whose delta sink raises (its consumer is gone) is aborted; the rest go on."""
    engine = oracle.engine()
    streams = Streams()

    def broken(delta: StreamDelta) -> None:
        streams.sink(delta)
        raise RuntimeError("the event loop is closed")

    engine.add_request(PROMPTS[0], GREEDY, "a", streams.sink)
    engine.add_request(PROMPTS[1], GREEDY, "bad", broken)
    ends = []
    while engine.has_work():
        ends += [d for d in engine.step() if d.request_id == "bad" and d.finished]
        engine.check_integrity()
    assert len(streams.deltas["bad"]) == 1  # handed one delta, then dropped
    assert [(d.finish_reason, d.error) for d in ends] == [("abort", CONSUMER_FAILED)]
    assert streams.tokens("a") == oracle.greedy(PROMPTS[0], 6)
    _still_serves(engine, oracle)


def test_a_forward_that_raises_still_fails_the_step(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward is every request's: its failure is raised from `step`, not pinned on one."""
    engine = oracle.engine()
    engine.add_request(PROMPTS[0], GREEDY, "a")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "_hidden", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(3):
            engine.step()
    engine.close()


# ---- structured output, on the built-in tiny model (it has a tokenizer) -------------------------


CHOICE = SamplingParams(max_tokens=8, temperature=0.0, grammar=Grammar("choice", choices=("yes", "no")))
PLAIN = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TINY_PROMPTS = [[17, 230, 45, 99, 512, 8, 77], [5, 6, 7, 8], [300, 301, 302]]


def _tiny(overlap: str) -> Engine:
    return Engine(EngineConfig(model="tiny", max_total_tokens=4096, overlap_schedule=overlap))


def _is_bad(engine: Engine, matcher: object) -> bool:
    req: Req | None = engine.scheduler.reqs.get("bad")
    return req is not None and req.grammar is not None and matcher in (req.grammar, req.grammar.matcher)


def test_a_grammar_mask_that_raises_fails_alone(overlap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's mask fill raises because of one matcher: the rows are filled one by one, the
    failing one allows nothing and its request ends with a structured-output error; another
    constrained request and an unconstrained one get what they get alone."""
    import llguidance.torch

    engine = _tiny(overlap)
    want = engine.generate(TINY_PROMPTS[:2], [CHOICE, PLAIN])

    def par(executor: Any, pairs: list[Any], bitmask: torch.Tensor) -> None:
        if any(_is_bad(engine, m) for m, _ in pairs):
            raise RuntimeError("injected failure")
        fill_par(executor, pairs, bitmask)

    fill_par, fill_one = llguidance.torch.fill_next_token_bitmask_par, llguidance.torch.fill_next_token_bitmask
    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask_par", par)
    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask",
                        _raising_for(fill_one, lambda m, bitmask, i: _is_bad(engine, m)))  # fmt: skip
    streams = _run(engine, [("a", TINY_PROMPTS[0], CHOICE), ("b", TINY_PROMPTS[1], PLAIN),
                            ("bad", TINY_PROMPTS[2], CHOICE)])  # fmt: skip
    _failed_alone(streams, "bad", "structured output: the grammar could not compute the tokens allowed next")
    assert [streams.tokens("a"), streams.tokens("b")] == [o.token_ids for o in want]
    assert_all_free(engine)
    engine.close()


def test_a_grammar_that_raises_on_a_token_fails_alone(overlap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting the sampled token raises inside one request's matcher: that request ends with
    the token check's error; the others are untouched."""
    from worker.structured.grammar import GrammarMatcher

    engine = _tiny(overlap)
    want = engine.generate(TINY_PROMPTS[:2], [CHOICE, PLAIN])
    monkeypatch.setattr(GrammarMatcher, "accept",
                        _raising_for(GrammarMatcher.accept, lambda m, token: _is_bad(engine, m)))  # fmt: skip
    streams = _run(engine, [("a", TINY_PROMPTS[0], CHOICE), ("b", TINY_PROMPTS[1], PLAIN),
                            ("bad", TINY_PROMPTS[2], CHOICE)])  # fmt: skip
    _failed_alone(streams, "bad", TOKEN_CHECK_FAILED)
    assert [streams.tokens("a"), streams.tokens("b")] == [o.token_ids for o in want]
    assert_all_free(engine)
    engine.close()

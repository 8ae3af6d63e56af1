"""The compute-free stand-in runner: its pace, its tokens, and the real engine around it."""

from __future__ import annotations

import pytest
import torch

from core.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.errors import ConfigError
from worker.models.model_dir import load_tokenizer, resolve_model_dir
from worker.runner.forward_batch import ForwardBatch, ForwardReq, PromptRows
from worker.runner.sampler import SampleRow
from worker.runner.standin import NO_PROMPT_LOGPROBS, StandInRunner, mix64, plain_vocabulary


class FakeClock:
    """Time that moves only when waited on (the pacing's wait) or moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def _batch(n: int = 1, prompt_logprobs: bool = False) -> ForwardBatch:
    rows = PromptRows(0, (1,), 0) if prompt_logprobs else None
    reqs = tuple(ForwardReq([1, 2], 0, torch.arange(2), prompt_logprobs=rows) for _ in range(n))
    return ForwardBatch(reqs)


def test_a_step_takes_the_period_or_its_own_time_whichever_is_longer() -> None:
    clock = FakeClock()
    runner = StandInRunner(range(10), tokens_per_s=100.0, clock=clock, wait=clock.wait)
    runner.forward(_batch())  # the first step waits for nothing
    assert clock.waits == []
    clock.now += 0.004  # 4 ms of host work: the next step waits the 6 ms left of the period
    runner.forward(_batch())
    assert clock.waits == [pytest.approx(0.006)]
    clock.now += 0.025  # host work longer than the period: no wait at all
    runner.forward(_batch())
    assert len(clock.waits) == 1


def test_tokens_are_deterministic_per_request_and_step_and_skip_banned_ids() -> None:
    vocab = plain_vocabulary(50, excluded=(0, 1, 2))
    runner = StandInRunner(vocab, tokens_per_s=1e6)
    params = SamplingParams(max_tokens=4)
    rows = [SampleRow(params, key=k, step=s) for k in (7, 8) for s in range(20)]
    out = runner.sample(torch.empty(len(rows), 0), rows)
    again = runner.sample(torch.empty(len(rows), 0), rows)
    assert out.token_ids == again.token_ids
    assert set(out.token_ids) <= set(vocab) and len(set(out.token_ids)) > 10
    assert out.token_ids[:20] != out.token_ids[20:]  # two requests, two sequences
    first = vocab[mix64(7, 0) % len(vocab)]
    banned = runner.sample(torch.empty(1, 0), [SampleRow(params, key=7, step=0, banned=frozenset({first}))])
    assert banned.token_ids[0] not in (first, 0, 1, 2)
    assert out.logprobs == [None] * len(rows)


def test_logprobs_are_zero_and_prompt_logprobs_end_the_request() -> None:
    runner = StandInRunner(range(10), tokens_per_s=1e6)
    out = runner.sample(torch.empty(1, 0), [SampleRow(SamplingParams(logprobs=2), key=1, step=0)])
    assert out.logprobs == [0.0] and out.top_logprobs == [[(out.token_ids[0], 0.0)]]
    assert runner.forward(_batch(2, prompt_logprobs=True)).prompt_errors == {0: NO_PROMPT_LOGPROBS, 1: NO_PROMPT_LOGPROBS}


def test_the_engine_around_the_standin_emits_exactly_max_tokens_of_plain_text() -> None:
    engine = Engine(EngineConfig(model="tiny", standin_tokens_per_s=1e6))
    assert isinstance(engine.runner, StandInRunner)
    tokenizer = load_tokenizer(resolve_model_dir("tiny"))
    special = set(tokenizer.all_special_ids) | set(engine.parts.eos_token_ids)
    prompts = [tokenizer.encode("hello there"), tokenizer.encode("a b c d e f g")]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n) for n in (17, 33)])
    assert [len(o.token_ids) for o in outs] == [17, 33]
    assert all(o.finish_reason == "length" for o in outs)
    assert not special & {t for o in outs for t in o.token_ids}
    assert all(tokenizer.decode(o.token_ids) for o in outs)
    engine.check_integrity()


def test_the_standin_refuses_tensor_parallelism() -> None:
    with pytest.raises(ConfigError, match="standin_tokens_per_s"):
        EngineConfig(standin_tokens_per_s=10.0, tensor_parallel_size=2)

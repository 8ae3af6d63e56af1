"""Prompt logprobs through the engine: equal to the HF model's, chunked or not, on a prefix-cache
hit too (the cache is not used for their rows), and with max_tokens 0 (prompt only)."""

from __future__ import annotations

import pytest
import torch

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

PROMPT = tokens(90, seed=410)  # > chunked_prefill_size 64: two chunks


def _hf_prompt_logprobs(oracle: Oracle, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = oracle.model(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def test_prompt_logprobs_match_hf_chunked_and_on_cache_hit(oracle: Oracle) -> None:
    """The first entry is None; the rest equal HF's (1e-4), also when the prompt is cached."""
    engine = oracle.engine()
    want = _hf_prompt_logprobs(oracle, PROMPT)
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))[0]
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    out = engine.generate([PROMPT], asked)[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]
    assert len(got) == len(PROMPT) - 1
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert all(len(lp.top) == 2 for lp in out.prompt_logprobs[1:] if lp is not None)
    assert out.cached_tokens == 0 and out.token_ids == plain.token_ids
    assert_all_free(engine)


def test_max_tokens_zero_computes_the_prompt_only(oracle: Oracle) -> None:
    """max_tokens 0 with prompt logprobs: no token, finish reason length, the logprobs."""
    engine = oracle.engine()
    out = engine.generate([PROMPT[:20]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 20
    assert_all_free(engine)


def test_siblings_share_one_prefill(oracle: Oracle) -> None:
    """Choices of one prompt added with `follows`: the later ones reuse the first one's prompt."""
    engine = oracle.engine()
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    first = engine.add_request(PROMPT, params)
    later = [engine.add_request(PROMPT, params, follows=first) for _ in range(2)]
    outs = {}

    def collect(_: int) -> None:
        for rid in [first, *later]:
            req = engine.scheduler.reqs.get(rid)
            if req is not None:
                outs[rid] = req

    run_checked(engine, collect)
    assert outs[first].cached_tokens == 0
    assert all(outs[r].cached_tokens == 88 for r in later)  # floor_P(89): all but a partial page
    assert_all_free(engine)


def test_prompt_rows_become_logprobs_a_bounded_piece_at_a_time(
    oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LM head never sees more rows than the plan's `logprob_rows` (never a [chunk x vocab]
    tensor), and the pieces give HF's numbers."""
    engine = oracle.engine()
    assert engine.runner.logprob_rows == 18  # this engine's plan: 1/32 of 1.1 MiB of KV
    engine.runner.logprob_rows = 5
    head, seen = engine.runner.model.compute_logits, []

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return head(hidden)

    monkeypatch.setattr(engine.runner.model, "compute_logits", counted)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))[0]
    assert max(seen) <= 5 and sum(seen) >= len(PROMPT) - 1  # the prompt rows, then samples
    got = [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]  # type: ignore[index]
    want = _hf_prompt_logprobs(oracle, PROMPT)
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert_all_free(engine)


@pytest.mark.timeout(300)
def test_two_ranks_give_the_prompt_logprobs_of_one(oracle: Oracle) -> None:
    """Tensor parallelism gathers each piece's logits over the vocabulary shards: the same
    prompt logprobs and top tokens as one rank."""
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    one = oracle.engine().generate([PROMPT], params)[0]
    two = oracle.engine(tensor_parallel_size=2, overlap_schedule="off")
    try:
        got = two.generate([PROMPT], params)[0]
        two.check_integrity()
    finally:
        two.close()
    assert got.token_ids == one.token_ids
    assert got.prompt_logprobs is not None and one.prompt_logprobs is not None
    for a, b in zip(got.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert a is not None and b is not None and a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]

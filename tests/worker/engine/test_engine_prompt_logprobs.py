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

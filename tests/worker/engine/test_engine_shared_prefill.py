"""Requests that arrive together with a shared head (a system prompt) prefill it once: a
waiting request whose head a running request is still prefilling waits for it, then reuses it
(docs/design.md §11.1); tokens equal the oracle's, cache salts still share nothing, and a
short shared head holds nothing back."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.scheduler.scheduler import SHARED_PREFILL_MIN

pytestmark = pytest.mark.usefixtures("overlap")  # every engine test with overlap off and on

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=5)
SYSTEM = tokens(96, seed=71)


def _add(engine, prompts: list[list[int]], salts: list[str | None] | None = None) -> list[str]:
    salts = salts or [None] * len(prompts)
    return [engine.add_request(p, SamplingParams(cache_salt=s, **GREEDY)) for p, s in zip(prompts, salts)]


def test_a_shared_head_added_together_is_prefilled_once(oracle: Oracle) -> None:
    """Four prompts with one 96-token head, added at once (one step could take them all): the
    first computes the head, the other three wait a step and reuse all of it; the same tokens."""
    engine = oracle.engine(chunked_prefill_size=512)
    prompts = [SYSTEM + tokens(8, seed=80 + i) for i in range(4)]
    rids = _add(engine, prompts)
    engine.step()
    assert [rid in engine.scheduler.reqs and engine.scheduler.reqs[rid].kv is not None for rid in rids] == [True, False, False, False]
    outs = {}

    def collect(_: int) -> None:
        outs.update({rid: engine.scheduler.reqs[rid] for rid in rids if rid in engine.scheduler.reqs})

    run_checked(engine, collect)
    assert [outs[r].cached_tokens for r in rids] == [0, 96, 96, 96]
    for rid, prompt in zip(rids, prompts):
        assert outs[rid].output == oracle.greedy(prompt, 5)
    assert_all_free(engine)


def test_other_salts_and_short_heads_do_not_wait(oracle: Oracle) -> None:
    """A head shared under another cache salt is not reusable, and a head shorter than
    SHARED_PREFILL_MIN is not worth a step: all of them start in the first step."""
    engine = oracle.engine(chunked_prefill_size=512)
    short = SYSTEM[: SHARED_PREFILL_MIN - 4]
    prompts = [SYSTEM + tokens(8, seed=90), SYSTEM + tokens(8, seed=91),
               short + tokens(40, seed=92), short + tokens(40, seed=93)]  # fmt: skip
    rids = _add(engine, prompts, ["a", "b", None, None])
    engine.step()
    assert all(engine.scheduler.reqs[rid].kv is not None for rid in rids)
    run_checked(engine)
    assert_all_free(engine)


def test_a_burst_behind_one_head_waits_for_it_all(oracle: Oracle) -> None:
    """Forty prompts behind one head, more than a step's budget could start: still only the
    first starts in the first step; every other one reuses the whole head."""
    engine = oracle.engine(chunked_prefill_size=512)
    rids = _add(engine, [SYSTEM + tokens(8, seed=200 + i) for i in range(40)])
    engine.step()
    assert sum(engine.scheduler.reqs[rid].kv is not None for rid in rids) == 1
    outs = {}

    def collect(_: int) -> None:
        outs.update({rid: engine.scheduler.reqs[rid] for rid in rids if rid in engine.scheduler.reqs})

    run_checked(engine, collect)
    assert [outs[r].cached_tokens for r in rids] == [0] + [96] * 39
    assert_all_free(engine)


def test_every_waiting_request_is_checked_however_long_the_queue(oracle: Oracle) -> None:
    """300 prompts behind one head (a queue longer than any scan cap would look at): one step
    starts only the first of them, or a later one would compute the head again beside it."""
    engine = oracle.engine(chunked_prefill_size=512)
    rids = _add(engine, [SYSTEM + tokens(8, seed=500 + i) for i in range(300)])
    engine.step()
    assert sum(engine.scheduler.reqs[rid].kv is not None for rid in rids) == 1
    for rid in rids:
        engine.abort(rid)
    run_checked(engine)
    assert_all_free(engine)

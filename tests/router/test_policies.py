"""Policies through RouterCore (no Ray): the SWA-valid match decides, load and capacity weigh in."""

from __future__ import annotations

import pytest
from routing_builders import PAGE, index_with, load, prompt

from cluster.index import ClusterIndex
from cluster.messages import EventBatch, WorkerRemoved
from core.events import CacheEvent, EventKind, page_hashes
from router.core import Candidate, RouterCore
from router.cost import CostWeights
from router.policies import POLICIES, make_policy


def _core(index: ClusterIndex, policy: str = "swa_prefix", **weights: float) -> RouterCore:
    return RouterCore(index, make_policy(policy, CostWeights(**weights)))


def _cands(*wids: str) -> list[Candidate]:
    return [Candidate(w) for w in wids]


def test_tombstoned_tail_loses_to_live_copy() -> None:
    """Same full prefix on both; b's window tail is tombstoned → swa_prefix picks a, prefix ties."""
    tokens = prompt(6)
    index = index_with(tokens, {"a": "LLLLLL", "b": "LLLLTT"})
    for _ in range(4):  # ties rotate, so repeat: swa_prefix must pick `a` every time
        decision = _core(index).decide(tokens, _cands("a", "b"))
        assert decision.best.worker_id == "a"
        # b falls back to before its first tombstone: 4 of its 6 pages
        assert decision.predicted_for("a") == 6 * PAGE and decision.predicted_for("b") == 4 * PAGE
    prefix = _core(index, "prefix")
    picks = {prefix.decide(tokens, _cands("a", "b")).best.worker_id for _ in range(4)}
    assert picks == {"a", "b"}  # the baseline cannot tell them apart
    assert prefix.decide(tokens, _cands("a", "b")).predicted_for("b") == 6 * PAGE  # and is wrong


def test_prefix_picks_wrong_when_dead_prefix_is_longer() -> None:
    """b holds more pages but its tail is tombstoned: prefix picks b, swa_prefix picks a."""
    tokens = prompt(8)
    index = index_with(tokens, {"a": "LLLLL...", "b": "LTLTLTLT"})  # b: valid 1 page
    assert _core(index, "prefix").decide(tokens, _cands("a", "b")).best.worker_id == "b"
    decision = _core(index).decide(tokens, _cands("a", "b"))
    assert decision.best.worker_id == "a" and decision.predicted_for("a") == 5 * PAGE


def test_deeper_valid_match_wins_when_every_valid_is_short() -> None:
    """Valid < full on every worker: the deeper *valid* match wins, not the deeper full one."""
    tokens = prompt(10)
    #   a: full 10, valid 4 (tombstone at page 4, only 1 LIVE page after page 8's tombstone)
    #   b: full 8,  valid 6 (two LIVE pages 4..5 after the tombstone at 3)
    index = index_with(tokens, {"a": "LLLLTLLLTL", "b": "LLTLLLTL.."})
    core = _core(index)
    matches = core.match(tokens, ["a", "b"])
    assert (matches["a"].p_full, matches["a"].p_valid) == (10 * PAGE, 8 * PAGE)
    index = index_with(tokens, {"a": "LLLLTLTLTL", "b": "LLTLLLTL.."})
    matches = _core(index).match(tokens, ["a", "b"])
    assert (matches["a"].p_full, matches["a"].p_valid) == (10 * PAGE, 4 * PAGE)
    assert (matches["b"].p_full, matches["b"].p_valid) == (8 * PAGE, 6 * PAGE)
    assert _core(index).decide(tokens, _cands("a", "b")).best.worker_id == "b"
    assert _core(index, "prefix").decide(tokens, _cands("a", "b")).best.worker_id == "a"


def test_gap_counts_as_zero_until_resync() -> None:
    """After a sequence gap the worker's prediction is 0, so the other copy wins."""
    tokens = prompt(4)
    index = index_with(tokens, {"a": "LLLL", "b": "LL.."})
    index.apply(EventBatch("a", "inc", 2, (CacheEvent(EventKind.STORED, (1,)),)))  # seq 1 missing
    decision = _core(index).decide(tokens, _cands("a", "b"))
    assert decision.best.worker_id == "b" and decision.predicted_for("a") == 0


def test_dead_worker_never_chosen() -> None:
    """A removed worker, or one Serve no longer lists, is never ranked even with the best cache."""
    tokens = prompt(4)
    index = index_with(tokens, {"dead": "LLLL", "b": "...."})
    core = _core(index)
    assert [r.worker_id for r in core.decide(tokens, _cands("b")).ranked] == ["b"]
    index.apply_update(WorkerRemoved("dead"))
    decision = core.decide(tokens, _cands("dead", "b"))
    assert decision.predicted_for("dead") == 0
    assert index.page_map.get(page_hashes(tokens[:-1], PAGE)[0]) is None


def test_queue_outweighs_small_cache_hit() -> None:
    """A one-page hit does not justify waiting behind a long prefill queue."""
    tokens = prompt(4)
    index = index_with(tokens, {"a": "L...", "b": "...."})
    cands = [Candidate("a", load("a", queued=2000)), Candidate("b", load("b"))]
    assert _core(index).decide(tokens, cands).best.worker_id == "b"


def test_capacity_shortfall_avoided() -> None:
    """A worker whose pools cannot hold the request loses to one that can."""
    tokens = prompt(16)
    index = index_with(tokens, {"a": "LL", "b": ""})
    cands = [Candidate("a", load("a", free=8)), Candidate("b", load("b"))]
    assert _core(index).decide(tokens, cands).best.worker_id == "b"


def test_imbalance_guard_demotes_overloaded_worker() -> None:
    """A full-prefix hit is ignored when its worker is far above the lightest load."""
    tokens = prompt(64)
    index = index_with(tokens, {"a": "L" * 64, "b": ""})
    cands = [Candidate("a", load("a", queued=200)), Candidate("b", load("b"))]
    assert _core(index).decide(tokens, cands).best.worker_id == "a"
    cands = [Candidate("a", load("a", queued=250)), Candidate("b", load("b"))]
    guarded = _core(index, imbalance_abs_tokens=100.0)
    assert guarded.decide(tokens, cands).best.worker_id == "b"


def test_inflight_spreads_a_burst_between_samples() -> None:
    """Decisions made after a load sample count as load, so equal prompts alternate."""
    tokens = prompt(8)
    index = index_with(tokens, {"a": "", "b": ""})
    core = _core(index)
    cands = [Candidate("a", load("a", at=10.0)), Candidate("b", load("b", at=10.0))]
    picks = [
        core.decide(tokens, cands, request_key=f"r{i}", now=11.0).best.worker_id for i in range(4)
    ]
    assert picks.count("a") == 2 and picks.count("b") == 2
    fresh = [Candidate("a", load("a", at=12.0)), Candidate("b", load("b", at=12.0))]
    assert core.inflight.unsampled("a", 12.0) == (0, 0)  # the newer sample includes them
    core.decide(tokens, fresh, request_key="r9", now=13.0)
    core.complete("r9")
    assert core.inflight.unsampled("a", None) == (0, 0)
    assert core.inflight.unsampled("b", None) == (0, 0)


def test_least_loaded_ignores_cache() -> None:
    """least_loaded picks the lighter worker and still reports the valid prediction."""
    tokens = prompt(4)
    index = index_with(tokens, {"a": "LLLL", "b": ""})
    cands = [Candidate("a", load("a", decodes=3)), Candidate("b", load("b"))]
    decision = _core(index, "least_loaded").decide(tokens, cands)
    assert decision.best.worker_id == "b" and decision.predicted_for("a") == 4 * PAGE


def test_round_robin_rotates() -> None:
    """round_robin cycles through the candidates in id order."""
    tokens = prompt(2)
    core = _core(index_with(tokens, {"a": "LL", "b": "", "c": ""}), "round_robin")
    picks = [core.decide(tokens, _cands("c", "a", "b")).best.worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_every_candidate_ranked_once() -> None:
    """Each policy returns a permutation of the candidates."""
    tokens = prompt(3)
    index = index_with(tokens, {"a": "LLL", "b": "LT.", "c": ""})
    for name in POLICIES:
        ranked = _core(index, name).decide(tokens, _cands("a", "b", "c", "unknown")).ranked
        assert sorted(r.worker_id for r in ranked) == ["a", "b", "c", "unknown"]


def test_unknown_policy_names_the_choices() -> None:
    """A typo in the policy name says which names exist."""
    with pytest.raises(ValueError, match="swa_prefix"):
        make_policy("swa-prefix")


def test_no_window_counts_tombstones() -> None:
    """Without SWA layers (window None), full presence is the valid match."""
    tokens = prompt(3)
    index = index_with(tokens, {"a": "TTT"}, window=None)
    assert _core(index).decide(tokens, _cands("a")).predicted_for("a") == 3 * PAGE

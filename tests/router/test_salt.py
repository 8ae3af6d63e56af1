"""Cache salts in the router (docs/design.md §9.10): the index names a salt's pages by its own
chain, so a decision predicts a salt's prefix for that salt only; placements credit pending
pages under the request's chain, and moving a placement keeps it there."""

from __future__ import annotations

from routing_builders import PAGE, index_with, prompt

from core.events import ROOT_HASH, salted_root
from router.core import Candidate, RouterCore
from router.pending import PendingPages
from router.policies import make_policy

A, B = salted_root("tenant-a"), salted_root("tenant-b")
CANDS = [Candidate("a"), Candidate("b")]


def _core(layout: dict[str, str], tokens: list[int], root: int = ROOT_HASH) -> RouterCore:
    index = index_with(tokens, layout, root=root)
    return RouterCore(index, make_policy("swa_prefix"), pending=PendingPages(ttl_s=10.0))


def test_a_salts_prefix_is_predicted_for_that_salt_only() -> None:
    """Worker a holds the prompt under salt A: predicted (and chosen) for A; for B or no salt
    nothing is predicted anywhere, so the prediction header reveals nothing."""
    tokens = prompt(6)
    core = _core({"a": "LLLLLL", "b": ""}, tokens, root=A)
    mine = core.decide(tokens, CANDS, root_hash=A, now=1.0)
    assert mine.best is not None and mine.best.worker_id == "a"
    assert mine.predicted_for("a") == 6 * PAGE
    for root in (B, ROOT_HASH):
        other = core.decide(tokens, CANDS, root_hash=root, now=1.0)
        assert other.predicted_for("a") == other.predicted_for("b") == 0
        assert core.match(tokens, ["a"], root)["a"].p_full == 0


def test_pending_pages_are_credited_under_the_requests_salt() -> None:
    """A placement under salt A credits its prompt on that worker for A's next request only."""
    tokens = prompt(6)
    core = _core({"a": "", "b": ""}, tokens)
    best = core.decide(tokens, CANDS, request_key="r1", root_hash=A, now=1.0).best
    assert best is not None
    assert core.decide(tokens, CANDS, root_hash=A, now=1.5).predicted_for(best.worker_id) == 6 * PAGE
    for root in (B, ROOT_HASH):
        assert core.decide(tokens, CANDS, root_hash=root, now=1.5).predicted_for(best.worker_id) == 0


def test_a_moved_placement_keeps_its_salt() -> None:
    """Serve took the other replica: the pending pages move there, still under salt A."""
    tokens = prompt(6)
    core = _core({"a": "", "b": ""}, tokens)
    best = core.decide(tokens, CANDS, request_key="r1", root_hash=A, now=1.0).best
    assert best is not None
    other = "b" if best.worker_id == "a" else "a"
    core.placed("r1", tokens, other, now=1.1, root_hash=A)
    assert core.decide(tokens, CANDS, root_hash=A, now=1.5).predicted_for(other) == 6 * PAGE
    assert core.decide(tokens, CANDS, root_hash=B, now=1.5).predicted_for(other) == 0

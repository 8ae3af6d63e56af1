"""Routing across the host tier (docs/design.md §4.4, §9.9, §13): the router's view of a worker
is the worker's own `choose_reuse` on the tiered match, loads are priced in tokens of prefill,
and a placement that loads leaves its pages on the device for the next decision."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from routing_builders import PAGE, STATES, WINDOW, index_with, prompt

from cluster.index import ClusterIndex
from cluster.messages import EventBatch
from core.events import CacheEvent, EventKind, page_hashes
from core.geometry import Geometry
from core.reuse import TierCosts, choose_reuse, plan_reuse, tiered_match
from router.core import Candidate, RouterCore
from router.pending import PendingPages
from router.policies import make_policy

G = Geometry(PAGE, WINDOW, 2)  # R = ceil4(8 + 8) = 16 tokens
CHEAP = TierCosts(prefill=1.0, load_full=0.1, load_swa=0.05)
DEAR = TierCosts(prefill=1.0, load_full=3.0, load_swa=3.0)


def _core(index: ClusterIndex, policy: str = "swa_prefix") -> RouterCore:
    return RouterCore(index, make_policy(policy), pending=PendingPages())


def _cands(*wids: str) -> list[Candidate]:
    return [Candidate(w) for w in wids]


def _predicted(core: RouterCore, tokens: list[int], wid: str) -> tuple[int, int, int]:
    ranked = core.decide(tokens, _cands("a", "b"), now=1.0).ranked_for(wid)
    assert ranked is not None
    return ranked.predicted_cached_tokens, ranked.predicted_repaired_tokens, ranked.predicted_loaded_tokens


@settings(max_examples=300, deadline=None)
@given(
    st.text("LTSHX.", max_size=12),
    st.sampled_from([CHEAP, DEAR, TierCosts(1.0, 0.6, 0.9), None]),
    st.booleans(),
)
def test_prediction_is_the_workers_own_choice(layout: str, costs: TierCosts | None, repair: bool) -> None:
    """On every layout of states: (reused, repaired, loaded) = `choose_reuse` of `tiered_match`
    (the scheduler's call), or `plan_reuse` for a worker without a host tier."""
    if costs is None:
        layout = layout.replace("S", "L").replace("H", "L").replace("X", "T")  # no host tier
    tokens = prompt(12)
    core = _core(index_with(tokens, {"a": layout, "b": ""}, swa_layers=2, repair=repair, tier_costs=costs))
    states = [STATES.get(c) for c in layout] + [None] * (12 - len(layout))
    m = tiered_match(states, G)
    if costs is None:
        want = plan_reuse(m.p_full, m.p_valid, G, repair=repair)
    else:
        want = choose_reuse(m, G, costs, repair=repair)
    assert core.match(tokens, ["a"])["a"] == m
    assert _predicted(core, tokens, "a") == (want.reused, want.repaired, want.loaded_full + want.loaded_swa)


def test_a_cheap_load_is_predicted_and_a_dear_one_is_not() -> None:
    """A prefix on the host: with cheap loads the worker loads its full KV and the window's SWA
    KV; with loads dearer than prefill it recomputes, and the prediction says so."""
    tokens = prompt(6)
    core = _core(index_with(tokens, {"a": "HHHHHH", "b": ""}, swa_layers=2, tier_costs=CHEAP))
    assert _predicted(core, tokens, "a") == (24, 0, 24 + 8)
    assert core.decide(tokens, _cands("a", "b")).best.worker_id == "a"  # type: ignore[union-attr]
    core = _core(index_with(tokens, {"a": "HHHHHH", "b": ""}, swa_layers=2, tier_costs=DEAR))
    assert _predicted(core, tokens, "a") == (0, 0, 0)


def test_loads_are_priced_against_device_hits() -> None:
    """The same prefix on both workers: on a's device, on b's host. b costs its copies in tokens
    of prefill (`TierCosts`), so a wins, by exactly that much; the `prefix` baseline sees two
    equal hits."""
    tokens = prompt(6)
    index = index_with(tokens, {"a": "LLLLLL", "b": "HHHHHH"}, swa_layers=2, tier_costs=CHEAP)
    decision = _core(index).decide(tokens, _cands("a", "b"))
    costs = {r.worker_id: r.cost for r in decision.ranked}
    assert decision.best.worker_id == "a"  # type: ignore[union-attr]
    assert costs["b"] - costs["a"] == 24 * 0.1 + 8 * 0.05
    prefix = _core(index, "prefix").decide(tokens, _cands("a", "b"))
    assert {r.cost for r in prefix.ranked} == {costs["a"]}
    assert prefix.ranked_for("b").predicted_loaded_tokens == 0  # type: ignore[union-attr]


def test_interior_swa_on_the_host_stays_there() -> None:
    """Interior SWA on the host (tail_first's offload) is not loaded: only the window before the
    match end is, so a match ending in LIVE pages loads nothing."""
    tokens = prompt(6)
    core = _core(index_with(tokens, {"a": "LSSSLL", "b": ""}, swa_layers=2, tier_costs=CHEAP))
    assert _predicted(core, tokens, "a") == (24, 0, 0)
    branch = tokens[: 4 * PAGE] + [7, 7, 7, 7, 7]  # ends inside the host SWA: loads its window
    assert core.match(branch, ["a"])["a"].host_swa == 8
    assert core.decide(branch, _cands("a", "b")).ranked_for("a").predicted_loaded_tokens == 8  # type: ignore[union-attr]


def test_a_placement_that_loads_leaves_the_prefix_on_the_device() -> None:
    """Pending pages know what a load does: the full KV comes back (HOST → SWA_HOST), the
    window's SWA too (→ LIVE). The repeat reuses it all with no load; a branch ending inside
    the prefix still loads its own window's SWA; the worker's events then confirm the record."""
    tokens = prompt(6)
    index = index_with(tokens, {"a": "HHHHHH", "b": ""}, swa_layers=2, tier_costs=CHEAP)
    core = _core(index)
    assert core.decide(tokens, _cands("a", "b"), request_key="r1", now=1.0).best.worker_id == "a"  # type: ignore[union-attr]
    assert _predicted(core, tokens, "a") == (24, 0, 0)
    branch = tokens[: 3 * PAGE] + [7, 7, 7, 7, 7]
    m = core.match(branch, ["a"])["a"]
    assert (m.p_valid, m.p_device, m.host_full, m.host_swa) == (12, 0, 0, 8)
    chain = page_hashes(tokens[:-1], PAGE)
    events = (CacheEvent(EventKind.LOADED, tuple(chain)), CacheEvent(EventKind.SWA_LOADED, tuple(chain[4:])))
    index.apply(EventBatch("a", "inc", 1, events))
    assert _predicted(core, tokens, "a") == (24, 0, 0)
    assert len(core.pending) == 0 and core.pending.confirmed == 1


def test_a_repair_that_loads_credits_its_full_kv_on_the_device() -> None:
    """A repair through host tombstones loads their full KV: pending, they are device
    tombstones, and the revived tail is LIVE."""
    tokens = prompt(12)
    index = index_with(tokens, {"a": "LLXXXXXXXXXX", "b": ""}, swa_layers=2, repair=True, tier_costs=CHEAP)
    core = _core(index)
    assert _predicted(core, tokens, "a") == (48 - 16, 16, 40)
    core.decide(tokens, _cands("a"), request_key="r1", now=1.0)
    m = core.match(tokens, ["a"])["a"]
    assert (m.p_valid, m.p_device, m.host_full_all) == (48, 48, 0)

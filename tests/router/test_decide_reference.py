"""`RouterCore.decide`'s fast paths give the decision a straightforward computation gives.

The fast paths: idle workers' views reused between load samples (`RouterCore._views`), one
chain hashed per decision for the match and the placement, the policies' one-tuple sort keys
and round robin's rotation without a sort. The reference below builds every view afresh with
`RouterCore._view` and ranks by the cost model's functions and the rotation as documented, on
random indexes, loads (new samples and the same sample object again), placements, completions
and index updates between decisions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from routing_builders import PAGE, STATES, index_with, load, prompt

from cluster.messages import EventBatch
from core.events import ROOT_HASH, CacheEvent, EventKind, page_hashes
from router.core import Candidate, RankedWorker, RouterCore
from router.cost import WorkerView, capacity_tokens, load_tokens, overloaded, request_cost
from router.policies import POLICY_NAMES, Policy, make_policy

WORKERS = ("w0", "w1", "w2", "w3", "w4")
PAGES = 6


def _keys(policy: Policy, views: Sequence[WorkerView], prompt_tokens: int, max_new: int) -> tuple[list[float], list[tuple[float, ...]]]:
    w = policy.weights
    if policy.name in ("swa_prefix", "prefix"):
        loads = [load_tokens(v, w) for v in views]
        cached = policy.cached  # type: ignore[attr-defined]
        host = policy.host_load  # type: ignore[attr-defined]
        costs = [request_cost(v, cached(v), prompt_tokens, max_new, w, ld, host(v)) for v, ld in zip(views, loads)]
        over = overloaded(loads, w)
        return costs, [(float(over[i]), costs[i], loads[i]) for i in range(len(views))]
    if policy.name == "least_loaded":
        costs = [load_tokens(v, w) + capacity_tokens(v, prompt_tokens, max_new, w) for v in views]
        return costs, [(c,) for c in costs]
    return [0.0] * len(views), [()] * len(views)


def _reference(core: RouterCore, tokens: list[int], cands: list[Candidate], max_new: int, avoid: Sequence[str], now: float) -> tuple[RankedWorker, ...]:
    core.pending.settle(core.index, now)
    ordered = sorted(cands, key=lambda c: c.worker_id)
    matched = core._match(tokens, [c.worker_id for c in ordered], ROOT_HASH, None)
    views = [core._view(c, matched.get(c.worker_id)) for c in ordered]
    policy = core.policy
    costs, keys = _keys(policy, views, len(tokens), max_new)
    n, turn = len(views), policy._turn
    order = sorted(range(n), key=lambda i: (*keys[i], (i - turn) % n))
    order.sort(key=lambda i: views[i].worker_id in avoid)
    return tuple(
        RankedWorker(views[i].worker_id, policy.predicted(views[i]), costs[i], policy.predicted_repaired(views[i]),
                     policy.predicted_loaded(views[i]))
        for i in order
    )  # fmt: skip


_layout = st.text(alphabet="".join(STATES) + "..", min_size=PAGES, max_size=PAGES)
_step = st.tuples(
    st.integers(0, 3),  # prompt: three sharing their first pages, one sharing nothing
    st.lists(st.sampled_from(WORKERS), min_size=1, max_size=len(WORKERS), unique=True),  # candidates
    st.booleans(),  # a new load sample (else the previous objects again)
    st.integers(0, 3),  # 0: complete an earlier request, 1: an index update, else nothing
    st.lists(st.sampled_from(WORKERS), max_size=1),  # avoid
    st.integers(0, 64),  # max_new_tokens
)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(POLICY_NAMES),
    st.dictionaries(st.sampled_from(WORKERS[:4]), _layout, min_size=1),
    st.booleans(),
    st.lists(_step, min_size=1, max_size=12),
    st.randoms(use_true_random=False),
)
def test_decide_equals_the_straightforward_computation(
    policy: str, layout: dict[str, str], repair: bool, steps: list[tuple[int, list[str], bool, int, list[str], int]], rnd: random.Random
) -> None:
    base = prompt(PAGES)
    prompts = [base, base[: 3 * PAGE] + [7] * (3 * PAGE + 1), base[: PAGE * 2] + list(range(9000, 9000 + 4 * PAGE + 1)), prompt(PAGES, base=5000)]
    index = index_with(base, layout, swa_layers=2, repair=repair)
    core = RouterCore(index, make_policy(policy))
    loads = {w: load(w, queued=16 * i, decodes=i % 3, free=1 << (10 + i), at=0.0) for i, w in enumerate(WORKERS)}
    seqs = {w: 0 for w in layout}
    for t, (p, wids, fresh, action, avoid, max_new) in enumerate(steps):
        now = float(t)
        if fresh:
            loads = {w: load(w, queued=rnd.randrange(0, 600), decodes=rnd.randrange(0, 4), free=rnd.randrange(1, 1 << 12),
                             evictable=rnd.randrange(0, 1 << 10), at=now - 0.5) for w in WORKERS}  # fmt: skip
        cands = [Candidate(w, loads[w]) for w in wids]
        tokens = prompts[p]
        want = _reference(core, tokens, cands, max_new, avoid, now)
        got = core.decide(tokens, cands, max_new_tokens=max_new, request_key=f"r{t}", now=now, avoid=avoid)
        assert got.ranked == want
        if action == 0 and t:
            core.complete(f"r{t - 1}", now=now)
        elif action == 1 and got.best is not None and got.best.worker_id in seqs:
            wid = got.best.worker_id  # its pages arrive: the pending record may be confirmed
            seqs[wid] += 1
            entry = index.worker(wid)
            assert entry is not None
            new = tuple(h for h in page_hashes(tokens, PAGE) if h not in entry.pages)
            events = (CacheEvent(EventKind.STORED, new),) if new else ()
            index.apply(EventBatch(wid, "inc", seqs[wid], events))


def test_a_placing_decision_on_a_prompt_shorter_than_a_page_matches_nothing() -> None:
    """The whole chain is hashed for the placement; the walk reads none of it (an empty prompt
    or one token has no page before its last token)."""
    core = RouterCore(index_with(prompt(2), {"w0": "LL"}), make_policy())
    for tokens in ([], [5]):
        decision = core.decide(tokens, [Candidate("w0")], request_key=f"r{len(tokens)}")
        assert decision.predicted_for("w0") == 0

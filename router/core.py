"""The routing decision without Ray: index + hashing + match + policy → `RoutingDecision`.

`serve_router.py` is a thin adapter that turns Serve's `RunningReplica`s into `Candidate`s and
the decision back into ranks; everything testable lives here.

A request's page-hash chain starts from its root hash (`SamplingParams.root_hash`: its cache
salt's, docs/design.md §9.10), as the worker's does: the index holds each salt's pages under
their own hashes, so a prediction never counts another salt's prefix.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cluster.index import ClusterIndex, WorkerEntry
from cluster.messages import WorkerLoad
from core.events import ROOT_HASH
from core.geometry import Geometry
from core.reuse import Reuse, TieredMatch, choose_reuse, live_after, plan_reuse
from router.cost import UNKNOWN_GEOMETRY, WorkerView
from router.hashing import PageHasher
from router.inflight import InflightTracker
from router.match import match_chain
from router.pending import PendingPages
from router.policies import Policy, RequestView

# NOTE: `tuple.__new__(NamedTupleClass, values)` builds the same value as the class call at a
# third of its cost (one `WorkerView` and one `RankedWorker` per candidate per request); every
# field is given, in declaration order. WorkerView: worker_id, valid_cached, full_cached, load,
# extra_prefill_tokens, extra_requests, geometry, hybrid, repaired, loaded_full, loaded_swa,
# host_load_cost.
_new = tuple.__new__
_worker_id = operator.itemgetter(0)  # Candidate.worker_id
_MAX_IDLE_VIEWS = 4096  # cached views of workers holding none of a prompt (`RouterCore._views`)


class _Matches(NamedTuple):
    """A decision's match: the candidates the index knows (fresh), and each one's tiered match
    by its bit. NOTE: two dicts, not an (entry, match) tuple per worker: one allocation fewer
    per candidate per decision."""

    entries: dict[str, WorkerEntry]
    by_bit: dict[int, TieredMatch]

    def get(self, worker_id: str) -> tuple[WorkerEntry, TieredMatch] | None:
        entry = self.entries.get(worker_id)
        return None if entry is None else (entry, self.by_bit[entry.bit])


class Candidate(NamedTuple):  # one per replica per request: a NamedTuple is cheap to build
    worker_id: str  # the id the replica stamps on its cache events
    load: WorkerLoad | None = None


class RankedWorker(NamedTuple):  # one per candidate per request: a NamedTuple is cheap to build
    worker_id: str
    predicted_cached_tokens: int  # what the policy believes this worker will reuse
    cost: float  # the policy's score (lower is better); comparable only within one decision
    predicted_repaired_tokens: int = 0  # of the rest, what it believes the worker recomputes as a repair
    predicted_loaded_tokens: int = 0  # of the cached ones, what it believes come from the host tier


@dataclass(frozen=True)
class RoutingDecision:
    """One decision: every candidate, best first, with its predicted cached tokens."""

    policy: str
    ranked: tuple[RankedWorker, ...]

    @property
    def best(self) -> RankedWorker | None:
        return self.ranked[0] if self.ranked else None

    def ranked_for(self, worker_id: str) -> RankedWorker | None:
        """The rank of the replica that actually serves (it may not be the first one when that
        was full); None when the worker was not a candidate."""
        return next((r for r in self.ranked if r.worker_id == worker_id), None)

    def predicted_for(self, worker_id: str) -> int | None:
        """The predicted cached tokens on that replica."""
        ranked = self.ranked_for(worker_id)
        return None if ranked is None else ranked.predicted_cached_tokens


class RouterCore:
    def __init__(
        self,
        index: ClusterIndex,
        policy: Policy,
        hasher: PageHasher | None = None,
        inflight: InflightTracker | None = None,
        pending: PendingPages | None = None,
    ) -> None:
        self.index = index
        self.policy = policy
        self.hasher = hasher or PageHasher()
        self.inflight = inflight or InflightTracker()
        self.pending = pending if pending is not None else PendingPages()  # it has a len()
        self._idle_views: dict[str, WorkerView] = {}

    def decide(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[Candidate],
        *,
        max_new_tokens: int = 0,
        request_key: str | None = None,
        now: float | None = None,
        avoid: Sequence[str] = (),
        root_hash: int = ROOT_HASH,
    ) -> RoutingDecision:
        """Rank the candidates for one prompt (workers in `avoid` last); with `request_key`,
        count it as in flight on the first-ranked worker, and its prompt's pages as pending
        there, until its completion (`complete`) or what `router.inflight` / `router.pending`
        say ends them earlier. `root_hash`: the request's (its cache salt's)."""
        now = time.time() if now is None else now
        self.pending.settle(self.index, now)
        ordered = sorted(candidates, key=_worker_id)
        # A placement records the whole prompt's chain: hash it once, for the match too.
        chains: dict[int, list[int]] | None = {} if request_key is not None else None
        matched = self._match(token_ids, [c.worker_id for c in ordered], root_hash, chains)
        views = self._views(ordered, matched)
        order, costs = self.policy.rank(RequestView(len(token_ids), max_new_tokens), views)
        if avoid:
            order.sort(key=lambda i: views[i].worker_id in avoid)  # stable
        policy = self.policy
        predicted, repaired, loaded = policy.predicted, policy.predicted_repaired, policy.predicted_loaded
        ranked = []
        for i in order:
            v = views[i]
            ranked.append(_new(RankedWorker, (v.worker_id, predicted(v), costs[i], repaired(v), loaded(v))))
        decision = RoutingDecision(policy.name, tuple(ranked))
        if request_key is not None and order:
            best = views[order[0]]
            best_match = matched.get(best.worker_id)  # one tuple, for the placed worker only
            self._place(request_key, token_ids, best, best_match, now, root_hash, chains)
        return decision

    def placed(
        self,
        request_key: str,
        token_ids: Sequence[int],
        worker_id: str,
        now: float | None = None,
        root_hash: int = ROOT_HASH,
    ) -> None:
        """Serve sent the request to `worker_id`; move its records there if they sit elsewhere
        (the first rank was full and Serve took the next one)."""
        recorded = self.inflight.worker_of(request_key)
        if recorded is None or recorded == worker_id:
            return
        now = time.time() if now is None else now
        self.pending.complete(request_key)
        matched = self._match(token_ids, [worker_id], root_hash, None).get(worker_id)
        view = self._view(Candidate(worker_id), matched)
        self._place(request_key, token_ids, view, matched, now, root_hash, None)

    def complete(self, request_key: str, now: float | None = None) -> None:
        self.inflight.complete(request_key, time.time() if now is None else now)
        self.pending.complete(request_key)

    def forget_worker(self, worker_id: str) -> None:
        self._idle_views.pop(worker_id, None)
        self.inflight.forget_worker(worker_id)
        self.pending.forget_worker(worker_id)

    def _place(
        self,
        request_key: str,
        token_ids: Sequence[int],
        view: WorkerView,
        matched: tuple[WorkerEntry, TieredMatch] | None,
        now: float,
        root_hash: int,
        chains: dict[int, list[int]] | None,
    ) -> None:
        uncached = max(0, len(token_ids) - view.valid_cached)
        self.inflight.record(request_key, view.worker_id, uncached, now)
        if matched is None:  # not in the index yet (or stale): nothing to predict pages on
            self.pending.complete(request_key)
            return
        entry = matched[0]
        geometry = entry.meta.geometry
        reuse = Reuse(view.valid_cached, view.repaired, view.loaded_full, view.loaded_swa)
        first_live, loaded_end = device_after(reuse, view.full_cached, geometry)
        page = geometry.page_size
        chain = chains.get(page) if chains is not None else None
        if chain is None:
            chain = self.hasher.hashes(token_ids, page, root_hash)
        loaded = chain[: min(loaded_end, first_live) // page]
        self.pending.record(request_key, entry, chain[first_live // page :], now, loaded)

    def match(
        self, token_ids: Sequence[int], worker_ids: Sequence[str], root_hash: int = ROOT_HASH
    ) -> dict[str, TieredMatch]:
        """Per known, fresh worker: its tiered match in tokens for this prompt.

        The worker computes at least one token, so it matches `token_ids[:-1]`; so do we.
        """
        matched = self._match(token_ids, worker_ids, root_hash, None)
        return {wid: matched.by_bit[e.bit] for wid, e in matched.entries.items()}

    def _match(
        self,
        token_ids: Sequence[int],
        worker_ids: Sequence[str],
        root_hash: int,
        chains: dict[int, list[int]] | None,
    ) -> _Matches:
        """Per known, fresh worker: its index entry and tiered match. With `chains`, the whole
        prompt's chain is hashed per page size and left there (for `_place`); without, only the
        pages the walk pulls."""
        entries: dict[str, WorkerEntry] = {}
        by_page_size: dict[int, list[WorkerEntry]] = {}
        worker = self.index.worker
        for wid in worker_ids:
            entry = worker(wid)
            if entry is not None and not entry.stale:
                entries[wid] = entry
                by_page_size.setdefault(entry.meta.geometry.page_size, []).append(entry)
        by_bit: dict[int, TieredMatch] = {}
        if not entries:
            return _Matches(entries, by_bit)
        pages = self.pending.overlay(self.index.page_map)
        last = max(0, len(token_ids) - 1)  # the match covers token_ids[:-1]
        for page_size, group in by_page_size.items():
            geometries = {e.bit: e.meta.geometry for e in group}
            hashes: Iterable[int]
            if chains is None:
                hashes = self.hasher.iter_hashes(token_ids[:last], page_size, root_hash)
            else:
                chain = chains[page_size] = self.hasher.hashes(token_ids, page_size, root_hash)
                hashes = itertools.islice(chain, last // page_size)  # the prefix's pages
            by_bit.update(match_chain(hashes, pages, geometries))
        return _Matches(entries, by_bit)

    def _views(self, ordered: Sequence[Candidate], matched: _Matches) -> list[WorkerView]:
        """One `WorkerView` per candidate. A worker holding none of the prompt (most of a large
        fleet, for any one prompt) gets the view it got last time when its load sample and this
        router's corrections are the same objects/values: no allocation, no work per decision
        between stats updates."""
        unsampled = self.inflight.unsampled
        idle = self._idle_views
        entries, by_bit = matched
        views: list[WorkerView] = []
        for cand in ordered:
            wid, load = cand
            extra_tokens, extra_requests = unsampled(wid, load.timestamp_s if load is not None else None)
            entry = entries.get(wid)
            if entry is not None:
                m = by_bit[entry.bit]
                if m[0]:  # some of the prompt's full KV there
                    views.append(self._matched_view(wid, load, extra_tokens, extra_requests, entry, m))
                    continue
                geometry, hybrid = entry.meta.geometry, entry.meta.hybrid
            else:
                geometry, hybrid = UNKNOWN_GEOMETRY, False
            view = idle.get(wid)
            if (
                view is None
                or view.load is not load
                or view.extra_prefill_tokens != extra_tokens
                or view.extra_requests != extra_requests
                or view.geometry is not geometry
                or view.hybrid is not hybrid
            ):
                view = _new(WorkerView, (wid, 0, 0, load, extra_tokens, extra_requests, geometry, hybrid, 0, 0, 0, 0.0))
                if len(idle) >= _MAX_IDLE_VIEWS:
                    idle.clear()  # workers that left; the live ones come back at once
                idle[wid] = view
            views.append(view)
        return views

    def _view(self, cand: Candidate, matched: tuple[WorkerEntry, TieredMatch] | None) -> WorkerView:
        load = cand.load
        extra_tokens, extra_requests = self.inflight.unsampled(
            cand.worker_id, load.timestamp_s if load is not None else None
        )
        if matched is None:
            return WorkerView(cand.worker_id, 0, 0, load, extra_tokens, extra_requests)
        return self._matched_view(cand.worker_id, load, extra_tokens, extra_requests, *matched)

    def _matched_view(
        self,
        worker_id: str,
        load: WorkerLoad | None,
        extra_tokens: int,
        extra_requests: int,
        entry: WorkerEntry,
        m: TieredMatch,
    ) -> WorkerView:
        meta = entry.meta
        geometry = meta.geometry
        p_full, p_valid, p_device = m[0], m[1], m[2]
        repair = meta.tombstone_repair and meta.hybrid
        if p_device == p_valid and (p_full == p_valid or not repair):
            # Nothing to load or repair: what every rule returns.
            return _new(WorkerView, (worker_id, p_valid, p_full, load, extra_tokens, extra_requests,
                                     geometry, meta.hybrid, 0, 0, 0, 0.0))  # fmt: skip
        costs = meta.tier_costs
        host_cost = 0.0
        if costs is None or (p_device == p_valid and not m[5] and costs.prefill > 0):
            # No host KV along the match: `choose_reuse` is `plan_reuse` (core/reuse.py), cheaper.
            reuse = plan_reuse(p_full, p_valid, geometry, repair=repair)
        else:  # the worker's own rule (core/reuse.py): the prediction is its decision
            reuse = choose_reuse(m, geometry, costs, repair=repair)
            if costs.prefill > 0:  # in tokens of prefill, the cost model's unit
                host_cost = (reuse.loaded_full * costs.load_full + reuse.loaded_swa * costs.load_swa) / costs.prefill
        reused, repaired, loaded_full, loaded_swa = reuse
        return _new(WorkerView, (worker_id, reused, p_full, load, extra_tokens, extra_requests, geometry,
                                 meta.hybrid, repaired, loaded_full, loaded_swa, host_cost))  # fmt: skip


def device_after(reuse: Reuse, p_full: int, g: Geometry) -> tuple[int, int]:
    """What a placed request leaves on its worker's device (tokens): pages LIVE from the first
    number on, and the full KV of `[0, second)` loaded from the host tier (their SWA KV stays
    where it was).

        [0, loaded_end)                 full KV loaded (a repair: up to p_full; a load: p_valid)
        [first_live, ...)               LIVE: computed and inserted (docs/design.md §10.1), a
                                        repair's revived tail (§9.8), or a load's window pages
                                        whose SWA KV came back with their full KV (§9.9)
    """
    first_live = live_after(reuse, p_full, g)
    if reuse.loaded_swa and not reuse.repaired and g.window is not None:
        first_live = max(0, reuse.reused - g.ceil(g.window))
    loaded_end = reuse.reused + reuse.repaired if reuse.loaded_full else 0
    return first_live, loaded_end

"""The routing decision without Ray: index + hashing + match + policy → `RoutingDecision`.

`serve_router.py` is a thin adapter that turns Serve's `RunningReplica`s into `Candidate`s and
the decision back into ranks; everything testable lives here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from cluster.index import ClusterIndex, WorkerEntry
from cluster.load import WorkerLoad
from router.cost import WorkerView
from router.hashing import PageHasher
from router.inflight import InflightTracker
from router.match import WorkerMatch, match_chain
from router.policies import Policy, RequestView
from router.request import RankedWorker, RoutingDecision


class Candidate(NamedTuple):  # one per replica per request: a NamedTuple is cheap to build
    worker_id: str  # the id the replica stamps on its cache events
    load: WorkerLoad | None = None


class RouterCore:
    def __init__(
        self,
        index: ClusterIndex,
        policy: Policy,
        hasher: PageHasher | None = None,
        inflight: InflightTracker | None = None,
    ) -> None:
        self.index = index
        self.policy = policy
        self.hasher = hasher or PageHasher()
        self.inflight = inflight or InflightTracker()

    def decide(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[Candidate],
        *,
        max_new_tokens: int = 0,
        request_key: str | None = None,
        now: float | None = None,
    ) -> RoutingDecision:
        """Rank the candidates for one prompt; with `request_key`, count it as in flight on
        the first-ranked worker until its next load sample or `complete(request_key)`."""
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        matches = self.match(token_ids, [c.worker_id for c in ordered])
        views = [self._view(c, matches.get(c.worker_id)) for c in ordered]
        ranked = self.policy.rank(RequestView(len(token_ids), max_new_tokens), views)
        decision = RoutingDecision(
            self.policy.name,
            tuple(
                RankedWorker(
                    views[r.index].worker_id, self.policy.predicted(views[r.index]), r.cost
                )
                for r in ranked
            ),
        )
        if request_key is not None and ranked:
            best = views[ranked[0].index]
            uncached = max(0, len(token_ids) - best.valid_cached)
            self.inflight.record(request_key, best.worker_id, uncached, now or time.time())
        return decision

    def complete(self, request_key: str) -> None:
        self.inflight.complete(request_key)

    def forget_worker(self, worker_id: str) -> None:
        self.inflight.forget_worker(worker_id)

    def match(self, token_ids: Sequence[int], worker_ids: Sequence[str]) -> dict[str, WorkerMatch]:
        """Per known, fresh worker: its full and valid match in pages for this prompt.

        The worker computes at least one token, so it matches `token_ids[:-1]`; so do we.
        """
        prefix = token_ids[: len(token_ids) - 1]
        by_page_size: dict[int, list[WorkerEntry]] = {}
        for wid in worker_ids:
            entry = self.index.worker(wid)
            if entry is not None and not entry.stale:
                by_page_size.setdefault(entry.meta.page_size, []).append(entry)
        out: dict[str, WorkerMatch] = {}
        for page_size, entries in by_page_size.items():
            windows = {e.bit: e.meta.window for e in entries}
            hashes = self.hasher.iter_hashes(prefix, page_size)
            by_bit = match_chain(hashes, self.index.page_map, windows, page_size)
            for e in entries:
                out[e.meta.worker_id] = by_bit[e.bit]
        return out

    def _view(self, cand: Candidate, match: WorkerMatch | None) -> WorkerView:
        entry = self.index.worker(cand.worker_id)
        sampled_at = cand.load.timestamp_s if cand.load else None
        extra_tokens, extra_requests = self.inflight.pending(cand.worker_id, sampled_at)
        if entry is None or match is None:
            return WorkerView(cand.worker_id, 0, 0, cand.load, extra_tokens, extra_requests)
        meta = entry.meta
        return WorkerView(
            worker_id=cand.worker_id,
            valid_cached=match.valid_pages * meta.page_size,
            full_cached=match.full_pages * meta.page_size,
            load=cand.load,
            extra_prefill_tokens=extra_tokens,
            extra_requests=extra_requests,
            window=meta.window,
            page_size=meta.page_size,
            hybrid=meta.hybrid,
        )

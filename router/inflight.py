"""What this router placed that a worker's last load sample does not show as it is now.

A worker's `record_routing_stats` sample is about a second old when the router reads it, and in
that second two things happen that the router knows of and the sample does not:

    placed at ──── sample taken ──── completed         sample says   correction
    before          ts                after ts           in flight     − its load (a credit)
    after ts        —                 not yet            nothing       + its load (extra)
    after ts        —                 already            nothing       none

Each decision records (worker, time, prefill tokens). Until a sample taken after it arrives, a
record counts as extra load on its worker (a burst does not pile onto one worker between two
samples). When a request the sample includes completes, it becomes a credit until a sample taken
after the completion arrives: a client's next turn must not find its own finished request still
counted as load there (that ranks the worker holding its cache away on a stale sample).

NOTE: a credit takes back the request's prefill tokens and one running decode; the sample holds
one or the other (it was prefilling or decoding then), so `router.cost` clamps each corrected
count at 0. NOTE: "taken after" compares the worker's `time.time()` with the router's; on one
host or an NTP-synced cluster the skew is far below the sample period. The router assumes the
first-ranked worker serves the request until Serve says which did (`RouterCore.placed` records
it again there).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Record:
    at: float
    prefill_tokens: int
    done_at: float | None = None  # when the router heard it completed


@dataclass(slots=True)
class _Worker:
    sampled_at: float = float("-inf")  # the newest sample a decision has seen
    # Placed after `sampled_at`, oldest first; completed ones stay until the next sample
    # tells whether it included them.
    fresh: OrderedDict[str, _Record] = field(default_factory=OrderedDict)
    sampled: OrderedDict[str, _Record] = field(default_factory=OrderedDict)  # in it, running
    credits: list[_Record] = field(default_factory=list)  # in it, completed after it
    extra_tokens: int = 0  # Σ running fresh records
    extra_requests: int = 0


class InflightTracker:
    def __init__(self, max_per_worker: int = 4096) -> None:
        self._max = max_per_worker
        self._worker_of: dict[str, str] = {}  # running requests only
        self._workers: dict[str, _Worker] = {}

    def record(self, key: str, worker_id: str, prefill_tokens: int, at: float) -> None:
        """Place request `key` on `worker_id` (a retry of the same key moves it)."""
        self._discard(key)
        w = self._workers.setdefault(worker_id, _Worker())
        w.fresh[key] = _Record(at, prefill_tokens)
        w.extra_tokens += prefill_tokens
        w.extra_requests += 1
        self._worker_of[key] = worker_id
        for records in (w.fresh, w.sampled):
            while len(records) > self._max:
                self._discard(next(iter(records)), worker_id)

    def worker_of(self, key: str) -> str | None:
        return self._worker_of.get(key)

    def complete(self, key: str, at: float) -> None:
        worker_id = self._worker_of.pop(key, None)
        if worker_id is None:
            return
        w = self._workers[worker_id]
        rec = w.fresh.get(key)
        if rec is not None:
            rec.done_at = at  # the next sample seen decides whether it included the request
            w.extra_tokens -= rec.prefill_tokens
            w.extra_requests -= 1
            return
        rec = w.sampled.pop(key, None)
        if rec is not None:
            rec.done_at = at
            w.credits.append(rec)

    def unsampled(self, worker_id: str, sampled_at: float | None) -> tuple[int, int]:
        """(prefill tokens, requests) to add to the worker's sample taken at `sampled_at`
        (None: no sample yet): this router's placements since, minus its completions since of
        requests the sample includes. Either may be negative."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0, 0
        if sampled_at is not None and sampled_at > w.sampled_at:
            self._advance(w, sampled_at)
        if not w.credits:
            return w.extra_tokens, w.extra_requests
        credit = sum(r.prefill_tokens for r in w.credits)
        return w.extra_tokens - credit, w.extra_requests - len(w.credits)

    def forget_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        for key in [*w.fresh, *w.sampled]:
            if self._worker_of.get(key) == worker_id:
                del self._worker_of[key]

    def _advance(self, w: _Worker, sampled_at: float) -> None:
        """A newer sample: placements before it are in it; completions before it are not."""
        w.sampled_at = sampled_at
        while w.fresh:
            key, rec = next(iter(w.fresh.items()))
            if rec.at > sampled_at:
                break
            del w.fresh[key]
            if rec.done_at is None:
                w.extra_tokens -= rec.prefill_tokens
                w.extra_requests -= 1
                w.sampled[key] = rec
            elif rec.done_at > sampled_at:
                w.credits.append(rec)
        if w.credits:
            w.credits = [r for r in w.credits if r.done_at is not None and r.done_at > sampled_at]

    def _discard(self, key: str, worker_id: str | None = None) -> None:
        """Forget `key` without a credit (a retry, or the per-worker bound)."""
        worker_id = self._worker_of.pop(key, None) or worker_id
        if worker_id is None:
            return
        w = self._workers[worker_id]
        rec = w.fresh.pop(key, None)
        if rec is not None and rec.done_at is None:
            w.extra_tokens -= rec.prefill_tokens
            w.extra_requests -= 1
        w.sampled.pop(key, None)

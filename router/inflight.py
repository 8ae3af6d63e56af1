"""Requests this router placed that the workers' last load sample cannot include yet.

A worker's `record_routing_stats` sample is about a second old when the router reads it. Each
decision records (worker, time, prefill tokens); a record counts as extra load on that worker
until a sample taken after it arrives (the sample then includes it) or the request completes.

NOTE: "taken after" compares the worker's `time.time()` with the router's; on one host or an
NTP-synced cluster the skew is far below the sample period. We assume the first-ranked worker
serves the request; when it was full Serve falls through to the next rank, and this record is
off by one request until the next sample.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Record:
    at: float
    prefill_tokens: int


class InflightTracker:
    def __init__(self, max_per_worker: int = 4096) -> None:
        self._max = max_per_worker
        self._worker_of: dict[str, str] = {}
        self._records: dict[str, OrderedDict[str, _Record]] = {}

    def record(self, key: str, worker_id: str, prefill_tokens: int, at: float) -> None:
        """Place request `key` on `worker_id` (a retry of the same key moves it)."""
        self.complete(key)
        records = self._records.setdefault(worker_id, OrderedDict())
        records[key] = _Record(at, prefill_tokens)
        self._worker_of[key] = worker_id
        while len(records) > self._max:
            old_key, _ = records.popitem(last=False)
            self._worker_of.pop(old_key, None)

    def complete(self, key: str) -> None:
        worker_id = self._worker_of.pop(key, None)
        if worker_id is not None:
            self._records[worker_id].pop(key, None)

    def pending(self, worker_id: str, sampled_at: float | None) -> tuple[int, int]:
        """(prefill tokens, requests) placed on the worker after its sample at `sampled_at`."""
        records = self._records.get(worker_id)
        if not records:
            return 0, 0
        if sampled_at is not None:
            while records:
                key, rec = next(iter(records.items()))
                if rec.at > sampled_at:
                    break
                records.popitem(last=False)
                self._worker_of.pop(key, None)
        return sum(r.prefill_tokens for r in records.values()), len(records)

    def forget_worker(self, worker_id: str) -> None:
        for key in self._records.pop(worker_id, {}):
            self._worker_of.pop(key, None)

"""The index actor's logic without Ray: accept worker updates, log them, serve router pulls.

Workers push `EventBatch`es and `WorkerResync`s; the hub applies each to its own `ClusterIndex`
(to detect gaps and answer "resync needed") and appends the ones that changed it to a bounded
log. Routers pull the log from their cursor and replay it into their local index, which is
therefore the same deterministic function of the same inputs. A router whose cursor is older
than the log (or from a previous actor life, `epoch`) gets a reset: one `WorkerResync` per worker.

    log:    [ base … base+len )      cursor = offset of the next update a router has not seen
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque

from cluster.index import ClusterIndex, IndexLimits
from cluster.messages import Delta, EventBatch, IndexUpdate, PushAck, WorkerRemoved, WorkerResync


class IndexHub:
    def __init__(self, limits: IndexLimits | None = None, max_log: int = 4096) -> None:
        if max_log < 1:
            raise ValueError(f"max_log must be >= 1, got {max_log}")
        self.epoch = uuid.uuid4().hex
        self.index = ClusterIndex(limits)
        self._log: deque[IndexUpdate] = deque(maxlen=max_log)
        self._base = 0

    @property
    def end(self) -> int:
        return self._base + len(self._log)

    def push(self, batch: EventBatch) -> PushAck:
        outcome = self.index.apply(batch)
        if outcome.changed:
            self._append(batch)
        return PushAck(resync_needed=outcome.resync_needed)

    def resync(self, update: WorkerResync) -> PushAck:
        outcome = self.index.resync(update)
        self._append(update)
        return PushAck(resync_needed=outcome.resync_needed)

    def remove(self, update: WorkerRemoved) -> bool:
        changed = self.index.apply_update(update).changed
        if changed:
            self._append(update)
        return changed

    def pull(self, epoch: str | None, cursor: int) -> Delta | None:
        """Updates after `cursor`; a reset when the router cannot continue; None when current."""
        if epoch != self.epoch or not self._base <= cursor <= self.end:
            updates: tuple[IndexUpdate, ...] = tuple(self.index.resyncs())
            return Delta(self.epoch, cursor, self.end, reset=True, updates=updates)
        if cursor == self.end:
            return None
        # NOTE: from the log's newest end: a router pulls the last few updates of a log of
        # thousands, and a deque slice from the front walks every entry before the cursor.
        newest_first = list(itertools.islice(reversed(self._log), self.end - cursor))
        updates = tuple(reversed(newest_first))
        return Delta(self.epoch, cursor, self.end, reset=False, updates=updates)

    def _append(self, update: IndexUpdate) -> None:
        if len(self._log) == self._log.maxlen:
            self._base += 1
        self._log.append(update)


def apply_delta(index: ClusterIndex, delta: Delta) -> None:
    """Replay a pulled delta into a router's local index."""
    if delta.reset:
        index.clear()
    for update in delta.updates:
        index.apply_update(update)

"""`ReplicaStatsBoard`: the last stats sample of every worker replica, kept by the index actor.

`/metrics` and `/health` need the stats of *every* replica of the worker deployment, which no
public Serve API hands to the ingress (a `DeploymentHandle` routes each call to one replica of
the router's choosing). So each worker replica sends its flat stats (routing stats plus every
engine number) to its deployment's index actor (`cluster.transport`), and the ingress reads all
of them with one awaited actor call.

When a replica reports:
- every time Serve calls its `record_routing_stats()` (about once a second, RUNNING replicas
  only): this registers the replica (`register=True`);
- after a request's first tokens and its end, with the replica's next push of cache events (the
  finished request's own flush, else the background flush within a quarter second), so a scrape
  soon after shows it at no actor call of its own; these only refresh a registered replica
  (`register=False`), so a replica that routers already dropped (draining, gone) does not come
  back.

A replica leaves the board on graceful shutdown and when a router sees it leave (both send
`WorkerRemoved`), and after `forget_after_s` without a report (it died unseen). Between
`stale_after_s` and `forget_after_s` without a report it is listed without stats: down.

No Ray here; `CacheIndexActor` holds one board (tests drive it directly).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.messages import STAT_TIMESTAMP_S, StatsDict

ReplicaSnapshot = dict[str, StatsDict | None]  # replica id -> flat stats, None: down


@dataclass(frozen=True, slots=True)
class _Sample:
    incarnation: str
    stats: StatsDict
    received_s: float  # board clock (the actor's), not the replica's


class ReplicaStatsBoard:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: dict[str, _Sample] = {}

    def report(
        self, worker_id: str, incarnation: str, stats: StatsDict, *, register: bool
    ) -> bool:
        """Keep `stats` as the replica's latest sample; False when it was ignored (an older
        sample of the same incarnation, or an unregistered replica and `register=False`)."""
        held = self._samples.get(worker_id)
        if held is None and not register:
            return False
        if held is not None and held.incarnation == incarnation:
            if float(stats.get(STAT_TIMESTAMP_S, 0.0)) < float(
                held.stats.get(STAT_TIMESTAMP_S, 0.0)
            ):
                return False  # reordered in flight: a newer sample is already here
        self._samples[worker_id] = _Sample(incarnation, dict(stats), self._clock())
        return True

    def remove(self, worker_id: str, incarnation: str | None = None) -> bool:
        """Drop the replica (`incarnation=None`: whichever one reported)."""
        held = self._samples.get(worker_id)
        if held is None or incarnation not in (None, held.incarnation):
            return False
        del self._samples[worker_id]
        return True

    def snapshot(self, stale_after_s: float, forget_after_s: float) -> ReplicaSnapshot:
        """Every replica's latest stats; None for one silent for over `stale_after_s`. Replicas
        silent for over `forget_after_s` are dropped first."""
        now = self._clock()
        for worker_id in [
            w for w, s in self._samples.items() if now - s.received_s > forget_after_s
        ]:
            del self._samples[worker_id]
        return {
            w: (dict(s.stats) if now - s.received_s <= stale_after_s else None)
            for w, s in sorted(self._samples.items())
        }

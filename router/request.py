"""What the ingress hands the worker deployment, and what the router writes back onto it.

The ingress calls the worker handle with a `RoutedRequest` as the **first positional argument**;
the router reads `token_ids` from it, decides, and replaces it with a copy whose `routing` holds
the `RoutingDecision`. The worker replica finds its own prediction with
`request.routing.predicted_for(worker_id)` and echoes it in its response; the ingress puts it in
the `x-swaserve-predicted-cached-tokens` header and reports it with the actual `cached_tokens` to
`router.metrics`. See router/README.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

PREDICTED_CACHED_TOKENS_HEADER = "x-swaserve-predicted-cached-tokens"


class RankedWorker(NamedTuple):  # one per candidate per request: a NamedTuple is cheap to build
    worker_id: str
    predicted_cached_tokens: int  # what the policy believes this worker will reuse
    cost: float  # the policy's score (lower is better); comparable only within one decision


@dataclass(frozen=True)
class RoutingDecision:
    """One decision: every candidate, best first, with its predicted cached tokens."""

    policy: str
    ranked: tuple[RankedWorker, ...]

    @property
    def best(self) -> RankedWorker | None:
        return self.ranked[0] if self.ranked else None

    def predicted_for(self, worker_id: str) -> int | None:
        """The prediction for the replica that actually serves (it may not be the first rank
        when that one was full); None when the worker was not a candidate."""
        for ranked in self.ranked:
            if ranked.worker_id == worker_id:
                return ranked.predicted_cached_tokens
        return None


@dataclass(frozen=True)
class RoutedRequest:
    """The first positional argument of every worker handle call."""

    token_ids: list[
        int
    ]  # the whole prompt (the router hashes token_ids[:-1], as the worker matches)
    request_id: str = ""
    max_new_tokens: int = 0  # for the capacity estimate; 0 when unknown
    params: object | None = None  # opaque to the router (the engine's sampling parameters)
    routing: RoutingDecision | None = None  # filled in by the router

    def with_routing(self, decision: RoutingDecision) -> RoutedRequest:
        return dataclasses.replace(self, routing=decision)

"""The routing record of one process: where the routers placed each request, with what they
predicted there, and which requests the ingress saw finish. Routers write it, the ingress reads
it by request id (`RoutedRequest.request_id`); neither the request nor the worker carries it.

Placements (router → ingress). When Serve reports which replica took a request
(`on_request_routed`), the router notes a `Placement`: that replica, the policy and the policy's
predicted cached, repaired and loaded tokens on it. The ingress reads it for the response headers and
the prediction metrics once the replica's `StreamStart` names the replica that serves; its
worker client reads it to rank a replica last that died before sending a `StreamStart`.

Completions (ingress → routers). Serve tells a router that a request completed
(`on_request_completed`) only after its result went back, which can be later than the same
client's next request. That request would then find the previous one still counted as load on
its worker and, until the index pull lands, that worker's new pages unknown: the cache hit goes
elsewhere. The ingress sees the worker's last delta, which the worker sends only after
publishing the request's cache events, and notes the request id here before it answers; routers
read the notes before every decision.

Both are bounded (`_MAX_KEPT` each, oldest dropped first) and guarded by one lock. NOTE: Serve
may run its routers on an event loop thread of their own, so writers and readers can be on
different threads.
NOTE: a module of its own on purpose. Serve pickles the router's module by value, so state kept
there would be a copy, not shared with the ingress (docs/design.md §14).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a router sent one request, and what its policy predicted there."""

    worker_id: str  # the replica Serve sent it to (its unique id)
    policy: str
    # None: no prediction for that replica (it was not among the decision's candidates)
    predicted_cached_tokens: int | None = None
    predicted_repaired_tokens: int | None = None
    predicted_loaded_tokens: int | None = None  # KV tokens from the host tier, full and SWA apart


_MAX_KEPT = 4096  # a router further behind than this only misses some early completions
_lock = threading.Lock()
_finished: deque[str] = deque(maxlen=_MAX_KEPT)
_noted = 0  # ids ever noted finished (the cursor space)
_placed: OrderedDict[str, Placement] = OrderedDict()  # request id -> its last placement


# ---- placements: routers write, the ingress reads ----------------------------------------------


def note_placed(request_id: str, placement: Placement) -> None:
    """A router: request `request_id` went to `placement.worker_id` (a retry replaces it)."""
    with _lock:
        _placed[request_id] = placement
        _placed.move_to_end(request_id)
        while len(_placed) > _MAX_KEPT:
            _placed.popitem(last=False)


def placement_of(request_id: str) -> Placement | None:
    """The last placement of `request_id` (None: not routed here, or forgotten)."""
    with _lock:
        return _placed.get(request_id)


# ---- completions: the ingress writes, routers read ---------------------------------------------


def note_finished(request_id: str) -> None:
    """The ingress: request `request_id` got its last delta."""
    global _noted
    with _lock:
        _finished.append(request_id)
        _noted += 1


def cursor() -> int:
    with _lock:
        return _noted


def finished_since(position: int) -> tuple[list[str], int]:
    """Ids noted after cursor `position` (the newest `_MAX_KEPT` at most), and the new cursor."""
    with _lock:
        end = _noted
        new = min(end - position, len(_finished))
        return (list(_finished)[len(_finished) - new :] if new > 0 else []), end

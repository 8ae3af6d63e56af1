"""Completions the ingress saw and placements the routers made, shared inside one process.

Serve tells a router that a request completed (`on_request_completed`) only after its result
went back, which can be later than the same client's next request. That request would then find
the previous one still counted as load on its worker and, until the index pull lands, that
worker's new pages unknown: the cache hit goes elsewhere. The ingress sees the worker's last
delta, which the worker sends only after publishing the request's cache events, and notes the
request id here before it answers; routers read the notes before every decision.

The other way round, a router notes which replica took each request (`note_placed`). A replica
that dies before the request's `StreamStart` came back leaves the ingress with no replica id to
rank last on the retry; `placed_on` gives it the router's.

NOTE: a module of its own on purpose. Serve pickles the router's module by value, so state kept
there would be a copy, not shared with the ingress (docs/design.md §14).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

_MAX_KEPT = 4096  # a router further behind than this only misses some early completions
_ids: deque[str] = deque(maxlen=_MAX_KEPT)
_noted = 0  # ids ever noted (the cursor space)
# request id -> worker id of the replica Serve sent it to, newest last. NOTE: Serve may run its
# routers on an event loop thread of their own, so the ingress reads this from another thread.
_placed: OrderedDict[str, str] = OrderedDict()
_placed_lock = threading.Lock()


def note_finished(request_id: str) -> None:
    """The ingress: request `request_id` (a `RoutedRequest.request_id`) got its last delta."""
    global _noted
    _ids.append(request_id)
    _noted += 1


def cursor() -> int:
    return _noted


def finished_since(position: int) -> tuple[list[str], int]:
    """Ids noted after cursor `position` (the newest `_MAX_KEPT` at most), and the new cursor."""
    end = _noted
    new = min(end - position, len(_ids))
    return (list(_ids)[len(_ids) - new :] if new > 0 else []), end


def note_placed(request_id: str, worker_id: str) -> None:
    """A router: request `request_id` went to worker `worker_id` (a replica unique id)."""
    with _placed_lock:
        _placed[request_id] = worker_id
        _placed.move_to_end(request_id)
        while len(_placed) > _MAX_KEPT:
            _placed.popitem(last=False)


def placed_on(request_id: str) -> str | None:
    """The worker the last placement of `request_id` went to (None: not routed here, or forgotten)."""
    with _placed_lock:
        return _placed.get(request_id)

"""Completions the ingress saw, for the routers living in the same process.

Serve tells a router that a request completed (`on_request_completed`) only after its result
went back, which can be later than the same client's next request. That request would then find
the previous one still counted as load on its worker and, until the index pull lands, that
worker's new pages unknown: the cache hit goes elsewhere. The ingress sees the worker's last
delta, which the worker sends only after publishing the request's cache events, and notes the
request id here before it answers; routers read the notes before every decision.

NOTE: a module of its own on purpose. Serve pickles the router's module by value, so state kept
there would be a copy, not shared with the ingress (docs/design.md §14).
"""

from __future__ import annotations

from collections import deque

_MAX_KEPT = 4096  # a router further behind than this only misses some early completions
_ids: deque[str] = deque(maxlen=_MAX_KEPT)
_noted = 0  # ids ever noted (the cursor space)


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

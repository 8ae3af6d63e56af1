"""A bound on each response write: a client that stops reading is cut off (docs/design.md §4.2).

A stream's client that stops reading (its TCP window full) makes the server's write wait, for
ever as far as the server can tell: the request keeps its admission share, its Serve slot and
its worker stream, and everything written meanwhile waits in memory. `WriteTimeout` wraps an ASGI
app so that a body write waiting longer than `timeout_s` ends the response: the app's `send`
raises `SlowReader`, the app unwinds (the stream's generator closes, which aborts the request on
its worker and frees its KV), and the connection is closed without the rest.

Two places wrap: `create_app` (our own app, where `send` is the server's), and, under
`swaserve serve`'s direct ingress, the replica's HTTP server itself
(`cluster.ray_private.direct_ingress_server`): there our app's `send` only queues messages for
Serve's loop, and Serve's loop is where a write waits on the client.

A write is a hot path (one per streamed chunk), so no timer is armed per write: a write notes
when it started, and one watchdog task per loop, running only while writes are in progress,
looks every `timeout_s / 4` (at most 1 s) and cancels the writes older than `timeout_s`, which
then raise `SlowReader`. A write is cut between `timeout_s` and `timeout_s` plus that period.

The server's wrapper also leaves its bounded `send` in the request's scope (`BODY_SEND`): the
SSE response (`deploy.openai.ingress._ClosingStream`) writes its middle chunks with it, past the
six ASGI layers between (Starlette's, ours, Serve's), each of which looks only at a response's
start or its last message; those two still go through every layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger("swaserve.ingress")

MAX_CHECK_PERIOD_S = 1.0
# The scope key under which the server-level `WriteTimeout` leaves its bounded `send`.
BODY_SEND = "swaserve.body_send"


class SlowReader(Exception):
    """A response write waited longer than the write timeout."""


class _Watch:
    """The writes in progress on one event loop, and their watchdog."""

    def __init__(self) -> None:
        self.writing: dict[asyncio.Task[Any], float] = {}  # task in a write -> when it started
        self.cut: set[asyncio.Task[Any]] = set()  # cancelled by the watchdog, not yet raised
        self.task: asyncio.Task[None] | None = None


class WriteTimeout:
    def __init__(self, app: Any, timeout_s: float, publish: bool = False) -> None:
        """`publish`: this wraps the HTTP server's app; leave the bounded `send` in each HTTP
        request's scope (`BODY_SEND`)."""
        self._app, self._timeout_s, self._publish = app, timeout_s, publish
        self._period_s = min(timeout_s / 4, MAX_CHECK_PERIOD_S)
        # per loop: one instance may serve several (tests start a loop per client)
        self._watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        watch = self._watches.get(loop)
        if watch is None:
            watch = self._watches[loop] = _Watch()

        async def bounded_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            task = asyncio.current_task()
            assert task is not None
            watch.writing[task] = time.monotonic()
            if watch.task is None:
                watch.task = loop.create_task(self._watch(watch))
            try:
                await send(message)
            except asyncio.CancelledError:
                if task not in watch.cut:
                    raise
                watch.cut.discard(task)
                if task.uncancel() > 0:
                    raise  # cancelled by someone else too (the client left): that wins
                raise SlowReader(f"the client read nothing for {self._timeout_s:g}s") from None
            else:
                if task in watch.cut:  # the write ended before the cut reached it
                    watch.cut.discard(task)
                    task.uncancel()
            finally:
                watch.writing.pop(task, None)

        if self._publish:
            scope[BODY_SEND] = bounded_send
        try:
            await self._app(scope, receive, bounded_send)
        except SlowReader as e:
            # The connection closes without the rest of the response (the server sees the app
            # return before the response's last message).
            log.warning("%s %s: %s; closing the connection", scope.get("method"), scope.get("path"), e)
        finally:
            # scope -> bounded_send -> the server's send -> its request cycle -> scope: a
            # reference cycle, left to the collector unless broken here.
            scope.pop(BODY_SEND, None)

    async def _watch(self, watch: _Watch) -> None:
        """Cancel each write older than the timeout; ends once no write is in progress."""
        try:
            while watch.writing:
                await asyncio.sleep(self._period_s)
                too_old = time.monotonic() - self._timeout_s
                for task, started in list(watch.writing.items()):
                    if started <= too_old and task not in watch.cut:
                        watch.cut.add(task)
                        task.cancel()
        finally:
            watch.task = None

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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger("swaserve.ingress")


class SlowReader(Exception):
    """A response write waited longer than the write timeout."""


class WriteTimeout:
    def __init__(self, app: Any, timeout_s: float) -> None:
        self._app, self._timeout_s = app, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def bounded_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(self._timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowReader(f"the client read nothing for {self._timeout_s:g}s") from None

        try:
            await self._app(scope, receive, bounded_send)
        except SlowReader as e:
            # The connection closes without the rest of the response (the server sees the app
            # return before the response's last message).
            log.warning("%s %s: %s; closing the connection", scope.get("method"), scope.get("path"), e)

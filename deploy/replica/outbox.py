"""A worker replica's side of an ingress's delta channel (`deploy/replica/channel.py`).

The requests of a subscribed ingress put their `StreamStart`s and deltas here (`put`, on the replica's loop, in
the order they leave their engine streams); the subscription's call takes everything put since
its last item as one `DeltaBatch` per wake-up. Nothing is held back: a batch leaves as soon as
the subscription's call runs again, so a batch is one engine step's deltas of that ingress, or
several when the channel's consumer (Serve's stream) was slower than the engine.

A channel ends once its ingress has had no request on this replica for `idle_s`: Serve's
graceful drain of a replica waits for every ongoing call, and a channel that never ended would
hold each scale-down for the whole `graceful_shutdown_timeout_s`. The ingress opens a new one at
its next `StreamStart` from the replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from cluster.messages import StreamStart, WorkerUnavailableError
from core.outputs import StreamDelta
from deploy.replica.channel import DeltaBatch

IDLE_S = 2.0  # a channel whose ingress has no request on the replica for this long ends


class Outbox:
    def __init__(self, subscription: str, idle: Callable[[], bool], idle_s: float = IDLE_S) -> None:
        self.subscription = subscription
        self._idle, self._idle_s = idle, idle_s
        self._items: list[tuple[str, StreamDelta | StreamStart]] = []
        self._wake = asyncio.Event()
        self.closed = False

    def put(self, nonce: str, item: StreamDelta | StreamStart) -> None:
        """Queue one item; raises once the channel is closed (its requests are lost to their
        ingress, which fails them: the caller's request aborts)."""
        if self.closed:
            raise WorkerUnavailableError(f"the delta channel {self.subscription} was closed")
        self._items.append((nonce, item))
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def wake(self) -> None:
        """Look at `idle()` again (its ingress's last request on the replica ended)."""
        self._wake.set()

    async def _wait(self) -> bool:
        """Wait for an item or the end; False when the channel stayed idle for `idle_s`."""
        if not self._idle():
            await self._wake.wait()
            return True
        try:
            async with asyncio.timeout(self._idle_s):
                await self._wake.wait()
        except TimeoutError:
            return not self._idle()
        return True

    async def batches(self) -> AsyncGenerator[DeltaBatch, None]:
        """The channel's items until `close()` (what was put before it still leaves)."""
        try:
            while True:
                if not await self._wait():
                    return
                self._wake.clear()
                if self._items:
                    items, self._items = self._items, []
                    yield DeltaBatch(items)
                if self.closed:
                    return
        finally:
            self.closed = True

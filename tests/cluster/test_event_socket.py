"""`cluster.event_socket` without Ray: a worker's pushes on the index actor's socket, in order,
each answered after it was applied; a connection without the token is closed unread; a closed
server fails the push (the publisher then resyncs, tests/cluster/test_transport_ray.py)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
from typing import Any

import pytest

from cluster.event_socket import HEADER, EventSocketClient, EventSocketServer


class Applied:
    def __init__(self, resync_after: int = 1 << 30) -> None:
        self.got: list[tuple[Any, Any]] = []
        self.threads: set[str] = set()
        self._resync_after = resync_after

    def __call__(self, batch: Any, stats: Any) -> bool:
        self.got.append((batch, stats))
        self.threads.add(threading.current_thread().name)
        return len(self.got) > self._resync_after


def test_pushes_arrive_in_order_and_each_answer_carries_the_resync_flag() -> None:
    applied = Applied(resync_after=2)
    server = EventSocketServer("127.0.0.1", applied)

    async def run() -> list[bool]:
        client = await EventSocketClient.connect(server.endpoint)
        answers = [await client.push({"seq": i}, {"n": i} if i % 2 else None) for i in range(4)]
        client.close()
        return answers

    try:
        assert asyncio.run(run()) == [False, False, True, True]
    finally:
        server.close()
    assert applied.got == [({"seq": i}, {"n": i} if i % 2 else None) for i in range(4)]
    assert applied.threads == {"swaserve-event-conn"}  # never on the accepting thread


def test_a_connection_without_the_token_is_closed_unread() -> None:
    applied = Applied()
    server = EventSocketServer("127.0.0.1", applied)
    host, port, token, proof = server.endpoint

    async def run() -> None:
        client = await EventSocketClient.connect((host, port, "0" * len(token), proof))
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await client.push({"seq": 1}, None, timeout_s=60)

    try:
        asyncio.run(run())
        with socket.create_connection((host, port)) as raw:  # a frame that is no token at all
            payload = pickle.dumps("not a token" * 100)
            raw.sendall(len(payload).to_bytes(HEADER, "little") + payload)
            try:
                assert raw.recv(1) == b""  # closed, nothing answered
            except ConnectionResetError:
                pass  # closed with our frame unread: a reset
    finally:
        server.close()
    assert applied.got == []


def test_a_failed_apply_ends_the_connection_and_a_closed_server_refuses_the_next() -> None:
    """The publisher sees an error (EOF), never a false answer, when the actor could not apply
    a push; once the actor is gone its port refuses a new connection."""

    def apply(batch: Any, stats: Any) -> bool:
        if batch["seq"] == 2:
            raise RuntimeError("the index could not apply it")
        return False

    server = EventSocketServer("127.0.0.1", apply)

    async def run() -> None:
        client = await EventSocketClient.connect(server.endpoint)
        assert await client.push({"seq": 1}, None) is False
        with pytest.raises(EOFError):
            await client.push({"seq": 2}, None, timeout_s=60)
        client.close()
        server.close()
        with pytest.raises(OSError):
            await EventSocketClient.connect(server.endpoint)

    asyncio.run(run())


# ---- EventPublisher over the socket, against an in-process stand-in for the actor -----------


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self._fn(*args)

        return call()


class StandInActor:
    """`CacheIndexActor`'s calls that `EventPublisher` makes, on an `IndexHub`, no Ray; its event
    socket (if `socket`) fails the pushes numbered in `fail`."""

    def __init__(self, socket: bool, fail: tuple[int, ...] = ()) -> None:
        from cluster.index_hub import IndexHub

        self.hub = IndexHub()
        self.call_pushes = 0
        self._socket_pushes = 0
        self._fail = fail
        self.server = EventSocketServer("127.0.0.1", self._on_socket) if socket else None
        self.event_endpoint = _Method(lambda: self.server.endpoint if self.server else None)
        self.push = _Method(self._on_call)
        self.resync = _Method(self.hub.resync)

    def _on_socket(self, batch: Any, stats: Any) -> bool:
        self._socket_pushes += 1
        if self._socket_pushes in self._fail:
            raise RuntimeError("lost")
        return self.hub.push(batch).resync_needed

    def _on_call(self, batch: Any, stats: Any) -> Any:
        self.call_pushes += 1
        return self.hub.push(batch)


def _publish(actor: StandInActor, pages: list[int]) -> Any:
    """Start a publisher for worker w0, push one page per batch; → (publisher, w0's pages in
    the actor's index)."""
    from cluster.index import ClusterIndex
    from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta
    from cluster.transport import EventPublisher
    from core.events import CacheEvent, EventKind, PageState
    from core.geometry import Geometry

    meta = WorkerMeta("w0", "i0", Geometry(4, 8), full_tokens=4096, swa_tokens=1024, hybrid=True)
    held: dict[int, PageState] = {}
    seq = 0

    def snapshot() -> CacheSnapshot:
        return CacheSnapshot("w0", "i0", seq, dict(held))

    async def run() -> EventPublisher:
        nonlocal seq
        publisher = EventPublisher(actor, meta, snapshot)  # type: ignore[arg-type]
        await publisher.start()
        for page in pages:
            held[page], seq = PageState.LIVE, seq + 1
            await publisher.publish(EventBatch("w0", "i0", seq, (CacheEvent(EventKind.STORED, (page,)),)))
        return publisher

    publisher = asyncio.run(run())
    index = ClusterIndex()
    for update in actor.hub.pull(None, 0).updates:  # type: ignore[union-attr]
        index.apply_update(update)
    snap = index.snapshot("w0")
    return publisher, set(snap.pages) if snap else None


def test_a_publisher_pushes_on_the_socket_and_resyncs_when_a_push_is_lost() -> None:
    actor = StandInActor(socket=True, fail=(2,))
    try:
        publisher, pages = _publish(actor, [1, 2, 3, 4])
    finally:
        assert actor.server is not None
        actor.server.close()
    # push 2 failed on the actor: a resync (the snapshot holds page 2), then a new connection
    assert pages == {1, 2, 3, 4} and actor.call_pushes == 0
    assert publisher.socket_pushes == 3 and publisher.resyncs == 2  # the start's, the loss's


def test_without_a_socket_the_pushes_are_actor_calls() -> None:
    actor = StandInActor(socket=False)
    publisher, pages = _publish(actor, [1, 2, 3])
    assert pages == {1, 2, 3} and actor.call_pushes == 3 and publisher.socket_pushes == 0


# ---- a router following the log -------------------------------------------------------------


def test_a_follower_gets_the_reset_then_each_push_as_it_is_applied() -> None:
    from cluster.event_socket import EventSocketFollower
    from cluster.index_hub import IndexHub
    from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerResync
    from core.events import CacheEvent, EventKind
    from core.geometry import Geometry

    hub, changed = IndexHub(), threading.Condition()
    meta = WorkerMeta("w0", "i0", Geometry(4, 8), full_tokens=4096, swa_tokens=1024, hybrid=True)
    hub.resync(WorkerResync(meta, CacheSnapshot("w0", "i0", 0, {})))

    def push(batch: Any, stats: Any) -> bool:
        with changed:
            ack = hub.push(batch)
            changed.notify_all()
        return ack.resync_needed

    def pull_wait(epoch: Any, cursor: int, wait_s: float) -> Any:
        with changed:
            delta = hub.pull(epoch, cursor)
            if delta is None:
                changed.wait(wait_s)
                delta = hub.pull(epoch, cursor)
        return delta

    server = EventSocketServer("127.0.0.1", push, pull_wait)

    async def run() -> list[Any]:
        follower = await EventSocketFollower.connect(server.endpoint, None, 0)
        pusher = await EventSocketClient.connect(server.endpoint)
        got = [await follower.next()]  # the reset: every worker's resync
        for seq in (1, 2):
            await pusher.push(EventBatch("w0", "i0", seq, (CacheEvent(EventKind.STORED, (seq,)),)), None)
            delta = None
            while delta is None:  # heartbeats until the push
                delta = await follower.next()
            got.append(delta)
        host, port, token, _ = server.endpoint
        with pytest.raises(PermissionError):  # an answer without the actor's proof
            await EventSocketFollower.connect((host, port, token, "f" * 32), None, 0)
        follower.close()
        pusher.close()
        return got

    try:
        reset, first, second = asyncio.run(run())
    finally:
        server.close()
    assert reset.reset and [type(u).__name__ for u in reset.updates] == ["WorkerResync"]
    assert not first.reset and [u.seq for u in first.updates] == [1]
    assert (second.since, [u.seq for u in second.updates]) == (first.cursor, [2])

"""The delta channel's socket (`deploy/replica/delta_socket.py`): frames in order across any cut
of the byte stream, refusals before anything is unpickled, the end of a connection; and a
worker replica (fake engine) streaming through `Channels` over it, in-process on loopback."""

from __future__ import annotations

import asyncio
import pickle
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from cluster.messages import RoutedRequest, StreamStart
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.replica.channel import DeltaBatch, OnSocket, StreamKey, Subscribe
from deploy.replica.channels import Channels
from deploy.replica.delta_socket import MAX_TOKEN, DeltaListener, DeltaSender, Items
from deploy.replica.deployment import WorkerDeployment, WorkerOptions
from tests.fakes.fake_engine import FakeEngine
from worker.config import EngineConfig

LOOPBACK = "127.0.0.1"
Runner = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def runner(request: pytest.FixtureRequest) -> Runner:
    """Each test on asyncio's loop and on uvloop's (Serve's replicas run uvloop, whose
    transports differ: not `asyncio.Transport` subclasses, a write after close raises)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def run(coro: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=factory) as r:
            r.run(coro)

    return run


def _delta(rid: str, n: int, finished: bool = False) -> StreamDelta:
    return StreamDelta(rid, [100 + n], finished, "length" if finished else None, 3, 0, n)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


async def _listening() -> tuple[DeltaListener, tuple[str, int]]:
    listener = DeltaListener(lambda: LOOPBACK)
    endpoint = await listener.start()
    assert endpoint is not None and endpoint[0] == LOOPBACK
    return listener, endpoint


async def _raw(endpoint: tuple[str, int], data: bytes, chunk: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that writes `data` `chunk` bytes at a time, draining between writes."""
    reader, writer = await asyncio.open_connection(*endpoint)
    for i in range(0, len(data), chunk):
        writer.write(data[i : i + chunk])
        await writer.drain()
        await asyncio.sleep(0)
    return reader, writer


def test_frames_arrive_whole_and_in_order_however_the_bytes_are_cut(runner: Runner) -> None:
    async def run() -> None:
        listener, endpoint = await _listening()
        batches = [[(f"n{b}", _delta(f"r{b}", i, i == 2)) for i in range(3)] for b in range(5)]
        data = b"".join(_frame(p) for p in [b"tok", *(pickle.dumps(b) for b in batches)])
        for chunk in (1, 3, 7, len(data)):
            got: list[Items] = []
            receiver = listener.expect("tok", got.append)
            _, writer = await _raw(endpoint, data, chunk)
            writer.close()
            assert await receiver.ended(30.0)
            assert got == batches and receiver.error is None, chunk
            receiver.close()
        listener.close()

    runner(run())


def test_a_connection_without_a_waited_for_token_is_closed_unread(runner: Runner) -> None:
    """Nothing after an unknown token is unpickled (a frame that would run code if it were);
    a second connection for a channel that has one is refused the same way; an oversized
    token frame too."""

    class Boom:
        def __reduce__(self) -> Any:
            return (exec, ("raise SystemExit('unpickled')",))

    async def run() -> None:
        listener, endpoint = await _listening()
        got: list[Items] = []
        receiver = listener.expect("good", got.append)
        evil = _frame(pickle.dumps(Boom()))
        for hello in (_frame(b"bad"), _frame(b"x" * (MAX_TOKEN + 1))):
            reader, writer = await _raw(endpoint, hello + evil, 4096)
            assert await reader.read() == b""  # closed by the listener
            writer.close()
        first = await DeltaSender.connect(endpoint, "good")
        await first.send([("n", _delta("r", 1))])
        reader, writer = await _raw(endpoint, _frame(b"good") + evil, 4096)
        assert await reader.read() == b""
        writer.close()
        await first.close()
        assert await receiver.ended(30.0)
        assert got == [[("n", _delta("r", 1))]] and receiver.error is None
        listener.close()

    runner(run())


def test_an_oversized_or_cut_frame_ends_the_connection_with_an_error(runner: Runner) -> None:
    async def run() -> None:
        listener, endpoint = await _listening()
        for tail in ((2**32 - 1).to_bytes(4, "little"), _frame(pickle.dumps([]))[:-2]):
            got: list[Items] = []
            receiver = listener.expect("t", got.append)
            _, writer = await _raw(endpoint, _frame(b"t") + tail, 4096)
            writer.close()
            assert await receiver.ended(30.0)
            assert isinstance(receiver.error, (ValueError, ConnectionError)) and got == []
            receiver.close()
        listener.close()

    runner(run())


def test_a_sender_to_a_closed_port_fails_to_connect(runner: Runner) -> None:
    async def run() -> None:
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]  # bound, never listening: refused
            try:
                await DeltaSender.connect((LOOPBACK, port), "t")
            except OSError:
                return
            raise AssertionError("connected to a port nobody listens on")

    runner(run())


# -- a worker replica's channel over the socket, through Channels --------------------------------


def _worker(idle_s: float) -> WorkerDeployment:
    cfg = EngineConfig(page_size=4, max_model_len=512)
    return WorkerDeployment(cfg, WorkerOptions(channel_idle_s=idle_s),
                            engine_factory=lambda c: FakeEngine(c, step_s=0.0), replica_id="w")  # fmt: skip


class _Ingress:
    """`Channels` whose calls go straight to an in-process worker replica (what Serve would
    carry), and whose channel batches come over the delta socket when it has one."""

    def __init__(self, w: WorkerDeployment, listener: DeltaListener | None) -> None:
        self.w = w
        self.items: list[DeltaBatch | OnSocket] = []  # what the channels' calls carried
        self.channels = Channels(self._subscribe, ingress_id="ing", listener=listener)

    async def _subscribe(self, sub: Subscribe) -> AsyncIterator[DeltaBatch | OnSocket]:
        async for item in self.w.deltas(sub):
            self.items.append(item)
            yield item

    async def stream(self, rid: str, tokens: int) -> list[Any]:
        req = RoutedRequest([1, 2, 3], rid, params=SamplingParams(max_tokens=tokens, ignore_eos=True))

        def call(key: StreamKey) -> AsyncIterator[Any]:
            return self.w.generate(req, key)  # type: ignore[return-value]

        return [x async for x in self.channels.attempt(req, call)]


def _check(items: list[Any], rid: str, tokens: int) -> None:
    assert isinstance(items[0], StreamStart)
    deltas = items[1:]
    assert all(isinstance(d, StreamDelta) and d.request_id == rid for d in deltas)
    assert sum(len(d.token_ids) for d in deltas) == tokens
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_a_workers_deltas_come_over_the_socket_complete_and_in_order(runner: Runner) -> None:
    """The first request opens the channel (inline); the 64 concurrent ones after it get every
    token over the socket, the call carrying only `OnSocket`; the channel then ends idle and
    the ingress's side waits for the socket's end before it closes (no attempt is failed)."""

    async def run() -> None:
        listener, _ = await _listening()
        w = _worker(idle_s=60.0)
        ing = _Ingress(w, listener)
        _check(await ing.stream("warm", 3), "warm", 3)
        await _until(lambda: ing.items)  # the channel is open
        assert ing.items == [OnSocket()]
        outs = await asyncio.gather(*(ing.stream(f"r{i}", 20 + i) for i in range(64)))
        for i, items in enumerate(outs):
            _check(items, f"r{i}", 20 + i)
            assert items[0].channel is not None  # the deltas went on the channel
        assert ing.items == [OnSocket()]  # and none of them on the call
        outbox = w._outboxes["ing"]
        outbox._idle_s = 0.0  # no request is left: the channel ends idle now
        outbox.wake()
        await _until(lambda: not ing.channels.open_replicas)  # idle: ended on both sides
        assert not listener._receivers
        w.shutdown()
        listener.close()

    runner(run())


def test_a_channel_whose_socket_cannot_be_reached_carries_its_batches_on_the_call(runner: Runner) -> None:
    async def run() -> None:
        listener, _ = await _listening()
        assert listener._server is not None
        listener._server.close()  # started, then gone: its endpoint refuses connections
        await listener._server.wait_closed()
        w = _worker(idle_s=60.0)
        ing = _Ingress(w, listener)
        _check(await ing.stream("warm", 3), "warm", 3)
        await _until(lambda: "ing" in w._outboxes)
        outs = await asyncio.gather(*(ing.stream(f"r{i}", 10) for i in range(8)))
        for i, items in enumerate(outs):
            _check(items, f"r{i}", 10)
        assert ing.items and all(isinstance(b, DeltaBatch) for b in ing.items)
        assert listener.endpoint in w._unreachable  # not tried again by the next channel
        tried: list[object] = []

        async def connect(*args: object) -> None:
            tried.append(args)
            raise AssertionError("tried an endpoint known to be unreachable")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DeltaSender, "connect", connect)
            assert listener.endpoint is not None
            assert await w._connect(Subscribe("w", "ing", "s2", listener.endpoint, "t")) is None
        assert tried == []
        await ing.channels.close()
        w.shutdown()

    runner(run())


async def _until(cond: Any, rounds: int = 100_000) -> None:
    """Turns of the loop until `cond()` holds (socket I/O needs the loop's selector: sleep(0)
    polls it once per turn), bounded by a count, not a clock."""
    for _ in range(rounds):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")

"""The delta channel's own faults (docs/design.md §4.2), in-process and scripted: the test
decides what each of the two sources (an attempt's request stream, the channel to its replica)
delivers and when, and waits on conditions of the event loop, never on time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from cluster.messages import EngineDiedError, RoutedRequest, StreamStart, WorkerUnavailableError
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.replica.channel import ChannelEnd, DeltaBatch, Moved, StreamKey, Subscribe
from deploy.replica.channels import Channels
from deploy.replica.client import ServeWorkerClient, replica_gone
from deploy.replica.deployment import WorkerDeployment, WorkerOptions
from tests.fakes.fake_engine import FakeEngine
from worker.config import EngineConfig

_END = object()


class Wire:
    """One scripted stream: what is pushed comes out in order; an exception pushed is raised."""

    def __init__(self) -> None:
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False

    def push(self, *items: Any) -> None:
        for item in items:
            self._q.put_nowait(item)

    async def items(self) -> AsyncIterator[Any]:
        try:
            while (item := await self._q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


class Script:
    """Channels over scripted wires: one channel wire per subscription, one request wire per
    attempt (in the order the attempts call)."""

    def __init__(self) -> None:
        self.channels = Channels(self._subscribe, ingress_id="ingress")
        self.subs: list[tuple[Subscribe, Wire]] = []
        self.calls: list[tuple[StreamKey, Wire]] = []
        self.pending: list[Wire] = []  # request wires made ahead, taken by the next calls

    def _subscribe(self, sub: Subscribe) -> AsyncIterator[DeltaBatch]:
        wire = Wire()
        self.subs.append((sub, wire))
        return wire.items()

    def call(self, key: StreamKey) -> AsyncIterator[Any]:
        wire = self.pending.pop(0) if self.pending else Wire()
        self.calls.append((key, wire))
        return wire.items()

    def channel(self, replica: str) -> tuple[str, Wire]:
        """The newest subscription to `replica` and its wire."""
        sub, wire = [(s, w) for s, w in self.subs if s.replica_id == replica][-1]
        return sub.subscription, wire


def _delta(rid: str, n: int, finished: bool = False) -> StreamDelta:
    return StreamDelta(rid, [100 + n], finished, "length" if finished else None, 3, 0, n)


async def until(cond: Callable[[], bool], rounds: int = 1000) -> None:
    """Let the loop run until `cond()` holds (a bounded number of turns, no clock)."""
    for _ in range(rounds):
        if cond():
            return
        await asyncio.sleep(0)  # a turn of the loop, not a wait on the clock
    raise AssertionError("condition not reached")


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)  # turns of the loop for queued callbacks, no clock


async def open_channel(s: Script, replica: str) -> str:
    """A first request to `replica`, inline (no channel there yet): its StreamStart opens one."""
    rid = f"warm-{replica}"
    wire = Wire()
    s.pending.append(wire)
    wire.push(StreamStart(replica), _delta(rid, 1, True), _END)
    got = [x async for x in s.channels.attempt(RoutedRequest([1], rid), s.call)]
    assert got == [StreamStart(replica), _delta(rid, 1, True)]
    await until(lambda: any(sub.replica_id == replica for sub, _ in s.subs))
    return s.channel(replica)[0]


async def started(s: Script, replica: str, rid: str) -> tuple[Any, StreamKey, Wire]:
    """An attempt bound to `replica`'s channel, its StreamStart received."""
    calls = len(s.calls)
    gen = s.channels.attempt(RoutedRequest([1], rid), s.call)
    first = asyncio.ensure_future(anext(gen))
    await until(lambda: len(s.calls) == calls + 1)
    key, wire = s.calls[-1]
    start = StreamStart(replica, channel=s.channel(replica)[0])
    wire.push(start)
    assert await first == start
    return gen, key, wire


async def calling(s: Script, rid: str) -> tuple[Any, asyncio.Future[Any], StreamKey, Wire]:
    """An attempt whose request call was made, nothing received yet: the generator, its first
    item (pending), the call's key and wire."""
    calls = len(s.calls)
    gen = s.channels.attempt(RoutedRequest([1], rid), s.call)
    first = asyncio.ensure_future(anext(gen))
    await until(lambda: len(s.calls) == calls + 1)
    key, wire = s.calls[-1]
    return gen, first, key, wire


def test_a_request_stream_error_comes_after_the_channel_deltas_before_it() -> None:
    """The worker's request stream raised after putting two deltas on the channel, and its
    error arrived first: both deltas are yielded, then the error."""

    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        gen, key, wire = await started(s, "a", "r")
        wire.push(ChannelEnd(2), EngineDiedError("its engine died"))
        nxt = asyncio.ensure_future(anext(gen))
        await settle()
        assert not nxt.done()  # waits for the two deltas the ChannelEnd counts
        s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta("r", 1)), (key.nonce, _delta("r", 2))]))
        assert await nxt == _delta("r", 1)
        assert await anext(gen) == _delta("r", 2)
        with pytest.raises(EngineDiedError):
            await anext(gen)
        assert not s.channels._keys

    asyncio.run(run())


def test_a_stream_that_ended_well_waits_for_every_final_delta_on_the_channel() -> None:
    """The request stream's end beat the channel's deltas (two choices): the attempt yields a
    delta that is not final and goes on waiting; it ends once both choices' final deltas came."""

    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        gen = s.channels.attempt(RoutedRequest([1], "r", sibling_params=(SamplingParams(),)), s.call)
        first = asyncio.ensure_future(anext(gen))
        await until(lambda: len(s.calls) == 2)
        key, wire = s.calls[-1]
        wire.push(StreamStart("a", channel=s.channel("a")[0]), _END)
        assert (await first).channel == s.channel("a")[0]
        nxt = asyncio.ensure_future(anext(gen))
        await settle()
        assert not nxt.done()  # ended, but no delta yet
        channel = s.channel("a")[1]
        channel.push(DeltaBatch([(key.nonce, _delta("r", 1, True)), (key.nonce, _delta("r/1", 1))]))
        assert await nxt == _delta("r", 1, True)
        assert await anext(gen) == _delta("r/1", 1)
        last = asyncio.ensure_future(anext(gen))
        await settle()
        assert not last.done()  # "r/1" has no final delta yet
        channel.push(DeltaBatch([(key.nonce, _delta("r/1", 2, True))]))
        assert await last == _delta("r/1", 2, True)
        with pytest.raises(StopAsyncIteration):
            await anext(gen)
        assert not s.channels._keys

    asyncio.run(run())


def test_channel_deltas_that_beat_the_stream_start_wait_for_it() -> None:
    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        gen = s.channels.attempt(RoutedRequest([1], "r"), s.call)
        first = asyncio.ensure_future(anext(gen))
        await until(lambda: len(s.calls) == 2)
        key, wire = s.calls[-1]
        s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta("r", 1, True))]))
        await settle()
        assert not first.done()
        wire.push(StreamStart("a", channel=s.channel("a")[0]), _END)
        assert await first == StreamStart("a", channel=s.channel("a")[0])
        assert [x async for x in gen] == [_delta("r", 1, True)]

    asyncio.run(run())


def test_a_stream_start_on_the_channel_after_the_streams_end() -> None:
    """The worker put the StreamStart on the channel ahead of the deltas, and the request
    stream ended with no item before any of them came: the attempt waits, then yields the
    channel's StreamStart and deltas in order."""

    async def run() -> None:
        s = Script()
        sub = await open_channel(s, "a")
        gen, first, key, wire = await calling(s, "r")
        wire.push(_END)
        await settle()
        assert not first.done() and s.channels._unheard  # ended well, nothing heard yet
        s.channel("a")[1].push(DeltaBatch([(key.nonce, StreamStart("a", channel=sub)),
                                           (key.nonce, _delta("r", 1))]))  # fmt: skip
        assert await first == StreamStart("a", channel=sub)
        assert await anext(gen) == _delta("r", 1)
        nxt = asyncio.ensure_future(anext(gen))
        await settle()
        assert not nxt.done()  # no final delta yet
        s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta("r", 2, True))]))
        assert await nxt == _delta("r", 2, True)
        with pytest.raises(StopAsyncIteration):
            await anext(gen)
        assert not s.channels._keys and not s.channels._unheard

    asyncio.run(run())


def test_an_attempt_not_heard_from_fails_when_a_channel_fails() -> None:
    """Its request stream ended well with no item (everything on a channel), then a channel
    failed before its StreamStart came: lost (no token went out; the caller sends it again).
    Another channel ending well (idle) before that fails nothing."""

    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        await open_channel(s, "b")
        _, first, _, wire = await calling(s, "r")
        wire.push(_END)
        await until(lambda: bool(s.channels._unheard))
        s.channel("b")[1].push(_END)  # b's channel ends idle
        await until(lambda: "b" not in s.channels.open_replicas)
        await settle()
        assert not first.done() and s.channels._unheard
        s.channel("a")[1].push(ActorDiedError())
        with pytest.raises(Exception) as raised:
            await first
        assert replica_gone(raised.value) and not s.channels._unheard

    asyncio.run(run())


def test_a_channel_end_names_the_channel_its_stream_start_went_to() -> None:
    """The request stream failed before the StreamStart it put on the channel came: its
    `ChannelEnd` binds the attempt there (its counted deltas, then the error), or, when that
    channel has ended already, the attempt is lost at once."""

    async def run() -> None:
        s = Script()
        sub = await open_channel(s, "a")
        gen, first, key, wire = await calling(s, "r")
        wire.push(ChannelEnd(1, sub), EngineDiedError("its engine died"))
        await settle()
        assert not first.done()  # waits for the counted delta (and the StreamStart ahead of it)
        s.channel("a")[1].push(DeltaBatch([(key.nonce, StreamStart("a", channel=sub)),
                                           (key.nonce, _delta("r", 1))]))  # fmt: skip
        assert await first == StreamStart("a", channel=sub)
        assert await anext(gen) == _delta("r", 1)
        with pytest.raises(EngineDiedError):
            await anext(gen)

        _, nxt, _, wire = await calling(s, "q")
        wire.push(ChannelEnd(2, "ended-long-ago"), EngineDiedError("its engine died"))
        with pytest.raises(WorkerUnavailableError):
            await nxt

    asyncio.run(run())


def test_a_replica_killed_between_a_channel_delta_and_its_end() -> None:
    """A delta came on the channel, then the replica died (both calls fail, no ChannelEnd):
    the delta is yielded, then the replica's loss is raised, whichever call fails first."""

    for channel_first in (True, False):

        async def run(channel_first: bool = channel_first) -> None:
            s = Script()
            await open_channel(s, "a")
            gen, key, wire = await started(s, "a", "r")
            s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta("r", 1))]))
            assert await anext(gen) == _delta("r", 1)
            fails = [s.channel("a")[1], wire] if channel_first else [wire, s.channel("a")[1]]
            for w in fails:
                w.push(ActorDiedError())
            with pytest.raises(Exception) as raised:
                await anext(gen)
            assert replica_gone(raised.value)
            await until(lambda: "a" not in s.channels.open_replicas)

        asyncio.run(run())


def test_a_retried_attempts_late_deltas_are_dropped_never_mixed() -> None:
    """Attempt 1 lost its replica before its first token; its deltas still on a channel arrive
    while the retry streams: the retry yields its own deltas only."""

    async def run() -> list[Any]:
        s = Script()
        await open_channel(s, "a")
        await open_channel(s, "b")
        client = ServeWorkerClient(_Handle())  # type: ignore[arg-type]
        client._channels = s.channels
        first, second = Wire(), Wire()
        s.pending += [first, second]
        first.push(StreamStart("a", channel=s.channel("a")[0]), ChannelEnd(0),
                   WorkerUnavailableError("aborted on worker a; retry"))  # fmt: skip

        async def call(request: RoutedRequest, key: StreamKey) -> AsyncIterator[Any]:
            async for item in s.call(key):
                yield item

        client._call = call  # type: ignore[method-assign]
        out = client.stream(RoutedRequest([1], "r"))
        nxt = asyncio.ensure_future(anext(out))
        await until(lambda: len(s.calls) == 4)  # the two warm-ups, attempt 1, the retry
        (k1, _), (k2, _) = s.calls[2], s.calls[3]
        assert k1.nonce != k2.nonce
        second.push(StreamStart("b", channel=s.channel("b")[0]))
        s.channel("a")[1].push(DeltaBatch([(k1.nonce, _delta("r", 1))]))  # late: dropped
        s.channel("b")[1].push(DeltaBatch([(k1.nonce, _delta("r", 9)), (k2.nonce, _delta("r", 1))]))
        s.channel("b")[1].push(DeltaBatch([(k2.nonce, _delta("r", 2, True))]))
        second.push(_END)
        got = [await nxt] + [x async for x in out]
        assert not s.channels._keys
        assert got[0] == StreamStart("b", channel=s.channel("b")[0])
        return got[1:]

    assert asyncio.run(run()) == [_delta("r", 1), _delta("r", 2, True)]


def test_a_closed_requests_deltas_are_dropped() -> None:
    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        gen, key, wire = await started(s, "a", "r")
        channel = s.channel("a")[1]
        channel.push(DeltaBatch([(key.nonce, _delta("r", 1))]))
        assert await anext(gen) == _delta("r", 1)
        await gen.aclose()  # the client went away: its request stream is closed (the abort)
        assert wire.closed and not s.channels._keys
        gen2, key2, wire2 = await started(s, "a", "r2")
        channel.push(DeltaBatch([(key.nonce, _delta("r", 2)), (key2.nonce, _delta("r2", 1, True))]))
        wire2.push(_END)
        assert [x async for x in gen2] == [_delta("r2", 1, True)]

    asyncio.run(run())


def test_a_complete_attempt_closed_by_its_caller_lets_its_call_end() -> None:
    """The caller stops at the last final delta (it has every choice's) before the request
    stream's end came: the call is not cancelled but left to end by itself; closed earlier, it
    is cancelled at once (the abort)."""

    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        gen, key, wire = await started(s, "a", "r")
        s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta("r", 1, True))]))
        assert await anext(gen) == _delta("r", 1, True)
        await gen.aclose()  # the caller has every final delta: it stops here
        await settle()
        assert not wire.closed and len(s.channels._ending) == 1  # still reading its call
        wire.push(_END)
        await until(lambda: wire.closed and not s.channels._ending)
        assert not s.channels._keys
        gen2, key2, wire2 = await started(s, "a", "r2")
        s.channel("a")[1].push(DeltaBatch([(key2.nonce, _delta("r2", 1))]))
        assert await anext(gen2) == _delta("r2", 1)
        await gen2.aclose()  # not complete: cancelled now
        assert wire2.closed and not s.channels._ending

    asyncio.run(run())


def test_a_complete_attempts_call_that_does_not_end_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request stream left to end that does not is cancelled after `CALL_END_S` (here 0), and
    closing the channels cancels those still ending."""
    import deploy.replica.channels as channels_mod

    async def complete_and_close(s: Script, rid: str) -> Wire:
        gen, key, wire = await started(s, "a", rid)
        s.channel("a")[1].push(DeltaBatch([(key.nonce, _delta(rid, 1, True))]))
        assert await anext(gen) == _delta(rid, 1, True)
        await gen.aclose()
        return wire

    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        monkeypatch.setattr(channels_mod, "CALL_END_S", 0.0)
        first = await complete_and_close(s, "r")
        await until(lambda: first.closed and not s.channels._ending, rounds=100_000)
        monkeypatch.setattr(channels_mod, "CALL_END_S", 3600.0)
        second = await complete_and_close(s, "r2")
        assert not second.closed and len(s.channels._ending) == 1
        await s.channels.close()
        assert second.closed and not s.channels._ending

    asyncio.run(run())


def test_a_failing_channel_fails_only_the_requests_on_it_and_reopens() -> None:
    async def run() -> None:
        s = Script()
        await open_channel(s, "a")
        await open_channel(s, "b")
        on_a, ka, _ = await started(s, "a", "x")
        on_b, kb, wire_b = await started(s, "b", "y")
        s.channel("a")[1].push(ActorDiedError())
        with pytest.raises(Exception) as raised:
            await anext(on_a)
        assert replica_gone(raised.value)
        s.channel("b")[1].push(DeltaBatch([(kb.nonce, _delta("y", 1, True))]))
        wire_b.push(_END)
        assert [x async for x in on_b] == [_delta("y", 1, True)]
        assert s.channels.open_replicas == {"b"}
        await open_channel(s, "a")  # the next StreamStart from a opens a new channel
        assert len([sub for sub, _ in s.subs if sub.replica_id == "a"]) == 2

    asyncio.run(run())


class _Handle:
    app_name, deployment_name = "app", "Worker"

    def options(self, **_: Any) -> _Handle:
        return self


# -- the worker replica's side --------------------------------------------------------------


def _worker(idle_s: float = 60.0) -> WorkerDeployment:
    cfg = EngineConfig(page_size=4, max_model_len=512)
    return WorkerDeployment(cfg, WorkerOptions(channel_idle_s=idle_s),
                            engine_factory=lambda c: FakeEngine(c, step_s=0.0), replica_id="w")  # fmt: skip


def test_the_worker_puts_a_subscribed_ingress_deltas_on_its_channel() -> None:
    """The request stream carries nothing; the channel carries the attempt's `StreamStart`
    (naming it) and then all of its deltas, in order, each under the attempt's nonce. Another
    ingress's request stays inline."""

    async def run() -> None:
        w = _worker()
        batches = w.deltas(Subscribe("w", "ing", "sub1"))
        first = asyncio.ensure_future(anext(batches))
        await until(lambda: "ing" in w._outboxes)
        req = RoutedRequest([1, 2, 3], "r", params=SamplingParams(max_tokens=5, ignore_eos=True))
        items = [x async for x in w.generate(req, StreamKey("ing", "n1"))]
        assert items == []  # everything is on the channel
        got: list[tuple[str, Any]] = list((await first).items)
        while sum(getattr(d, "finished", False) for _, d in got) == 0:
            got += (await anext(batches)).items
        assert {n for n, _ in got} == {"n1"}
        assert got.pop(0)[1] == StreamStart("w", channel="sub1")  # ahead of every delta
        assert [t for _, d in got for t in d.token_ids] == [t for _, d in got for t in d.token_ids][:5]
        assert sum(len(d.token_ids) for _, d in got) == 5 and got[-1][1].finished
        other = [x async for x in w.generate(RoutedRequest([1, 2], "o"), StreamKey("other", "n2"))]
        assert other[0] == StreamStart("w") and isinstance(other[-1], StreamDelta) and other[-1].finished
        await batches.aclose()
        assert not w._outboxes
        w.shutdown()

    asyncio.run(run())


def test_a_channel_for_another_replica_is_refused() -> None:
    async def run() -> None:
        w = _worker()
        with pytest.raises(WorkerUnavailableError):
            await anext(w.deltas(Subscribe("gone", "ing", "s")))
        w.shutdown()

    asyncio.run(run())


def test_a_channel_ends_once_its_ingress_has_no_request_on_the_replica() -> None:
    """Serve's drain waits for every ongoing call: an idle channel must end (here at once)."""

    async def run() -> None:
        w = _worker(idle_s=0.0)
        batches = w.deltas(Subscribe("w", "ing", "s"))
        assert [b async for b in batches] == []
        assert not w._outboxes
        w.shutdown()

    asyncio.run(run())


def test_a_request_whose_channel_closed_under_it_fails_after_its_count() -> None:
    """The ingress gave the channel up (it opened another): the request's next put raises, its
    stream ends with the count of what went out, then the error; the engine request aborts."""

    async def run() -> None:
        w = _worker()
        old = w.deltas(Subscribe("w", "ing", "old"))
        first = asyncio.ensure_future(anext(old))
        await until(lambda: "ing" in w._outboxes)
        req = RoutedRequest([1, 2, 3], "r", params=SamplingParams(max_tokens=400, ignore_eos=True))
        items: list[Any] = []

        async def serve() -> None:  # Serve drives the replica's stream on its own
            async for item in w.generate(req, StreamKey("ing", "n1")):
                items.append(item)

        streaming = asyncio.ensure_future(serve())
        await first  # some deltas are on the old channel
        new = w.deltas(Subscribe("w", "ing", "new"))
        second = asyncio.ensure_future(anext(new))
        await until(lambda: w._outboxes["ing"].subscription == "new")
        with pytest.raises(WorkerUnavailableError):
            await streaming
        assert len(items) == 1 and isinstance(items[0], ChannelEnd)  # the StreamStart went on "old"
        assert items[0].deltas >= 1 and items[0].channel == "old"
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await new.aclose()
        await old.aclose()
        w.shutdown()

    asyncio.run(run())


def test_an_inline_attempt_moves_to_the_channel_in_order() -> None:
    """An attempt that began inline (the worker had no channel from this ingress yet) moves
    once it has one: its inline deltas first, then the channel's (one that beat the `Moved`
    waits for it), and it ends once the final delta came on the channel."""

    async def run() -> None:
        s = Script()
        sub = await open_channel(s, "a")
        gen, first, key, wire = await calling(s, "r")
        wire.push(StreamStart("a"), _delta("r", 1))
        assert await first == StreamStart("a")
        assert await anext(gen) == _delta("r", 1)
        channel = s.channel("a")[1]
        channel.push(DeltaBatch([(key.nonce, _delta("r", 2))]))
        nxt = asyncio.ensure_future(anext(gen))
        await settle()
        assert not nxt.done()  # on the channel, ahead of the Moved: it waits
        wire.push(Moved(sub))
        assert await nxt == _delta("r", 2)
        channel.push(DeltaBatch([(key.nonce, _delta("r", 3, True))]))
        wire.push(_END)
        assert [x async for x in gen] == [_delta("r", 3, True)]
        assert not s.channels._keys

    asyncio.run(run())


def test_an_inline_request_moves_to_its_ingress_channel_once_there_is_one() -> None:
    """A request that started inline (no channel from its ingress yet) yields its deltas on its
    call until the ingress subscribes; then `Moved` names the channel, the call yields nothing
    more, and the rest of its tokens go on the channel under its nonce, the final one last."""

    async def run() -> None:
        w = _worker()
        req = RoutedRequest([1, 2, 3], "r", params=SamplingParams(max_tokens=400, ignore_eos=True))
        gen = w.generate(req, StreamKey("ing", "n1"))
        assert await anext(gen) == StreamStart("w")
        inline = [await anext(gen)]
        batches = w.deltas(Subscribe("w", "ing", "sub1"))
        first = asyncio.ensure_future(anext(batches))
        await until(lambda: "ing" in w._outboxes)
        rest = [x async for x in gen]
        cut = rest.index(Moved("sub1"))
        assert rest[cut + 1 :] == []  # nothing more on the call
        inline += rest[:cut]
        assert all(isinstance(d, StreamDelta) and not d.finished for d in inline)
        got: list[tuple[str, Any]] = list((await first).items)
        while not any(getattr(d, "finished", False) for _, d in got):
            got += (await anext(batches)).items
        assert {n for n, _ in got} == {"n1"} and all(isinstance(d, StreamDelta) for _, d in got)
        assert got[-1][1].finished and sum(d.finished for _, d in got) == 1
        assert sum(len(d.token_ids) for d in inline) + sum(len(d.token_ids) for _, d in got) == 400
        await batches.aclose()
        w.shutdown()

    asyncio.run(run())

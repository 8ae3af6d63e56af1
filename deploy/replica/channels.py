"""An ingress replica's delta channels: one per worker replica, and each attempt's two sources.

`Channels.attempt` runs one attempt of a request: it registers the attempt's nonce, makes the
request's own call (`call(StreamKey)`: placement, refusals, errors, cancellation by closing it)
and yields what the caller of a plain request stream expects, `StreamStart` then `StreamDelta`s,
whichever way the worker sent them. The first `StreamStart` from a worker replica with no
channel open opens one (`subscribe(Subscribe)`, pinned to that replica by the router); a worker
with the channel open puts the attempt's `StreamStart` and deltas there, and its call yields
nothing while it runs well (docs/design.md §4.2).

The order between the two sources, per attempt:
- channel deltas that arrive before the `StreamStart` wait for it (a `StreamStart` on the
  call races the channel);
- an attempt that began inline (no channel on that replica yet) moves to the channel once the
  worker has one from this ingress (`Moved`, after its last inline delta): channel deltas that
  beat the `Moved` wait for it;
- a request stream that ended well with no item at all put everything on a channel not heard
  from yet: the attempt waits for that channel's `StreamStart`, and fails as lost when a
  channel of this ingress fails first (it has sent no token: the caller sends it again; a
  channel that ends well routed everything it carried before its end);
- the attempt ends when its request stream ended and every choice's final delta has come on
  the channel (the request stream ends right after the final deltas went out, so the attempt
  is never closed under a finished request: no cancel travels for it); a request stream that
  raises sends first how many deltas it put and where (`ChannelEnd`), and its error is raised
  once those came, after every delta put before it, and not at all once every choice has its
  final delta;
- a request stream that fails with no `ChannelEnd` (its replica died) raises at once: channel
  deltas of that attempt still in flight are dropped with it, as a retry's must be;
- the channel failing (its replica died, or the call ended under the attempt) raises at once, as
  the replica lost (the channel's own error when it is Ray's, else `WorkerUnavailableError`);
- deltas under a nonce no longer registered (a retried attempt's, a closed request's) are
  dropped: a retry's new nonce never receives them;
- an attempt closed by its caller once every choice's final delta came (the caller stops at the
  last one) leaves its request stream to end by itself, as the worker ends it right after
  those deltas, instead of cancelling it: a cancel costs both replicas a round of their own
  (and Serve a log line when the call's admission answer is still on the way, which the channel
  often beats). It is cancelled after `CALL_END_S`, or when the channels close.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from cluster.messages import RoutedRequest, StreamStart, WorkerUnavailableError
from core.outputs import StreamDelta
from deploy.replica.channel import ChannelEnd, DeltaBatch, Moved, OnSocket, StreamKey, Subscribe
from deploy.replica.delta_socket import DeltaListener, Receiver

RequestItem = StreamStart | StreamDelta | ChannelEnd | Moved
Call = Callable[[StreamKey], AsyncIterator[RequestItem]]
Subscriber = Callable[[Subscribe], AsyncIterator[DeltaBatch | OnSocket]]

SOCKET_END_S = 10.0  # after a channel's call ended well, how long its socket may take to close
CALL_END_S = 10.0  # after every final delta came, how long a request stream may take to end

log = logging.getLogger("swaserve.ingress")

# What an attempt's queue carries: a channel delta, a request-stream item, the request stream's
# end (None, or the exception it raised), or the channel lost (the exception to raise).
_DELTA, _ITEM, _END, _LOST = range(4)
_Event = tuple[int, object]


@dataclass(eq=False)
class _Attempt:
    queue: asyncio.Queue[_Event] = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _Channel:
    replica_id: str
    subscription: str
    attempts: set[_Attempt] = field(default_factory=set)  # bound by their `StreamStart.channel`
    task: asyncio.Task[None] | None = None


class Channels:
    def __init__(
        self, subscribe: Subscriber, ingress_id: str | None = None, listener: DeltaListener | None = None
    ) -> None:
        self.ingress_id = ingress_id or uuid.uuid4().hex
        self._subscribe = subscribe
        self._listener = listener  # the delta socket the workers send batches on, when one
        self._nonces = itertools.count()
        self._keys: dict[str, _Attempt] = {}  # nonce -> its attempt, while it runs
        self._live: dict[str, _Channel] = {}  # subscription -> channel, while its call runs
        self._by_replica: dict[str, _Channel] = {}
        self._unheard: set[_Attempt] = set()  # ended well, their channel's StreamStart not yet come
        self._ending: set[asyncio.Task[None]] = set()  # request streams of complete attempts

    @property
    def open_replicas(self) -> set[str]:
        return set(self._by_replica)

    async def attempt(
        self, request: RoutedRequest, call: Call
    ) -> AsyncGenerator[StreamStart | StreamDelta, None]:
        """One attempt of `request` through `call` (the module docstring's order)."""
        nonce = str(next(self._nonces))
        att = _Attempt()
        self._keys[nonce] = att
        pump = asyncio.create_task(_read(call(StreamKey(self.ingress_id, nonce)), att.queue))
        bound: _Channel | None = None
        unfinished = set(request.choice_ids)  # choices whose final delta has not come
        try:
            start: StreamStart | None = None
            early: list[StreamDelta] = []  # channel deltas that beat the StreamStart (or Moved)
            counted: int | None = None  # the ChannelEnd's count
            got = 0  # channel deltas received
            ended, failure = False, None
            while True:
                kind, item = await _next(att.queue)
                if kind == _DELTA:
                    assert isinstance(item, StreamDelta)
                    got += 1
                    if start is None or bound is None:  # no StreamStart, or inline: no Moved yet
                        early.append(item)
                        continue
                    if item.finished:  # before the yield: the caller may stop at it
                        unfinished.discard(item.request_id)
                    yield item
                elif kind == _ITEM:
                    if isinstance(item, StreamStart):
                        start = item
                        if item.channel is None and item.refusal is None:
                            self._ensure_channel(item.replica_id)
                        yield item
                        for delta in _held(early, unfinished):
                            yield delta
                        if item.channel is not None:
                            bound = self._bind(att, item.channel, start)
                    elif isinstance(item, Moved):  # after its last inline delta
                        bound = self._bind(att, item.channel, start)
                        for delta in _held(early, unfinished):
                            yield delta
                    elif isinstance(item, ChannelEnd):
                        counted = item.deltas
                        if bound is None and item.channel:  # its StreamStart not come yet
                            bound = self._bind(att, item.channel, start)
                    else:
                        assert isinstance(item, StreamDelta)
                        if item.finished:
                            unfinished.discard(item.request_id)
                        yield item  # no channel on that replica yet: inline
                elif kind == _END:
                    ended, failure = True, item
                else:
                    assert isinstance(item, BaseException)
                    raise item
                if ended and start is None and failure is None and counted is None:
                    self._unheard.add(att)  # it all went on a channel: wait for its StreamStart
                    continue
                self._unheard.discard(att)
                if ended and _complete(bound is not None and failure is None, counted, got, unfinished):
                    if failure is not None and unfinished:
                        assert isinstance(failure, BaseException)
                        raise failure
                    return
        finally:
            del self._keys[nonce]
            self._unheard.discard(att)
            if bound is not None:
                bound.attempts.discard(att)
            if not pump.done() and not unfinished:
                self._let_end(pump)  # complete: its request stream ends by itself
            else:
                pump.cancel()  # a no-op once it has ended
                await asyncio.gather(pump, return_exceptions=True)

    def _let_end(self, pump: asyncio.Task[None]) -> None:
        """A complete attempt's request stream, left to end by itself within `CALL_END_S`."""
        self._ending.add(pump)
        timer = asyncio.get_running_loop().call_later(CALL_END_S, pump.cancel)

        def ended(task: asyncio.Task[None]) -> None:
            timer.cancel()
            self._ending.discard(task)

        pump.add_done_callback(ended)

    def _bind(self, att: _Attempt, subscription: str, start: StreamStart | None) -> _Channel:
        """The attempt's channel, which it now hears of; lost when that channel has ended."""
        ch = self._live.get(subscription)
        if ch is None:
            raise WorkerUnavailableError(_lost(start))
        ch.attempts.add(att)
        return ch

    def _ensure_channel(self, replica_id: str) -> None:
        if replica_id in self._by_replica:
            return
        ch = _Channel(replica_id, uuid.uuid4().hex)
        self._live[ch.subscription] = self._by_replica[replica_id] = ch
        ch.task = asyncio.get_running_loop().create_task(self._run(ch))
        log.info("delta channel %s to worker %s opening", ch.subscription[:8], replica_id)

    async def _run(self, ch: _Channel) -> None:
        """Route the channel's batches into their attempts' queues, until it ends; then fail
        the attempts still bound to it."""
        error: BaseException | None = None
        endpoint = await self._listener.start() if self._listener is not None else None
        receiver: Receiver | None = None
        if endpoint is not None:
            assert self._listener is not None
            receiver = self._listener.expect(uuid.uuid4().hex, self._route)
        sub = Subscribe(ch.replica_id, self.ingress_id, ch.subscription, endpoint,
                        receiver.token if receiver is not None else "")  # fmt: skip
        ended_well = False  # every item of the channel routed: nothing of it still to come
        try:
            on_socket = False
            async with contextlib.aclosing(self._subscribe(sub)) as batches:  # type: ignore[type-var]
                async for batch in batches:
                    if isinstance(batch, OnSocket):
                        on_socket = receiver is not None
                        continue
                    self._route(batch.items)
                    # NOTE: gRPC hands out buffered items without suspending; a channel that is
                    # ahead would hold the loop (every stream's writes, /health) until it drained.
                    await asyncio.sleep(0)
            if on_socket:  # the worker closed the connection before the call ended
                assert receiver is not None
                if not await receiver.ended(SOCKET_END_S):
                    raise WorkerUnavailableError("its delta socket did not close after its call ended")
                if receiver.error is not None:
                    raise receiver.error
            ended_well = True
        except Exception as e:  # noqa: BLE001 - given to the attempts bound to it
            error = e
        finally:
            if receiver is not None:
                receiver.close()
            del self._live[ch.subscription]
            if self._by_replica.get(ch.replica_id) is ch:
                del self._by_replica[ch.replica_id]
            lost = _as_lost(error, ch.replica_id)
            if error is not None or ch.attempts:
                log.warning("delta channel %s to worker %s ended (%s); %d requests on it lost",
                            ch.subscription[:8], ch.replica_id, type(error).__name__ if error else "closed",
                            len(ch.attempts))  # fmt: skip
            for att in ch.attempts:
                att.queue.put_nowait((_LOST, lost))
            # Attempts still waiting for their channel's StreamStart may have waited for this
            # one, unless it ended well (it routed everything first): they fail too (no token
            # of theirs went out, so their caller sends them again).
            if not ended_well:
                for att in self._unheard:
                    att.queue.put_nowait((_LOST, lost))

    def _route(self, items: list[tuple[str, StreamDelta | StreamStart]]) -> None:
        """One batch of a channel (from its call or its socket) into its attempts' queues."""
        keys = self._keys
        for nonce, item in items:
            att = keys.get(nonce)
            if att is not None:  # else a lost or closed attempt's: dropped
                att.queue.put_nowait((_ITEM if type(item) is StreamStart else _DELTA, item))

    async def close(self) -> None:
        """End every channel (their attempts fail as lost) and the request streams still
        ending."""
        tasks = [ch.task for ch in self._live.values() if ch.task is not None] + list(self._ending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()


def _complete(on_channel: bool, counted: int | None, got: int, unfinished: set[str]) -> bool:
    """Whether an attempt whose request stream ended has every delta it will get: the count its
    `ChannelEnd` gave; else, when its stream ended well with its deltas on a channel, a final
    delta for every choice; else (inline deltas, or a stream that failed with no count) yes."""
    if counted is not None:
        return got >= counted
    return not (on_channel and unfinished)


def _held(early: list[StreamDelta], unfinished: set[str]) -> Iterator[StreamDelta]:
    """The channel deltas held for the item that lets them through (`StreamStart`, `Moved`),
    in order, emptied as they go; each final one ends its choice."""
    for delta in early:
        if delta.finished:
            unfinished.discard(delta.request_id)
        yield delta
    early.clear()


async def _next(queue: asyncio.Queue[_Event]) -> _Event:
    if queue.empty():
        return await queue.get()
    # NOTE: a queue that is ahead hands out items without suspending, and nothing on the way
    # to the SSE write suspends either: give the loop its turn once per item.
    await asyncio.sleep(0)
    return queue.get_nowait()


async def _read(stream: AsyncIterator[RequestItem], queue: asyncio.Queue[_Event]) -> None:
    """The request stream into the attempt's queue, then its end; closed here, in the task
    that iterates it (never from another task while it runs)."""
    try:
        async for item in stream:
            queue.put_nowait((_ITEM, item))
        queue.put_nowait((_END, None))
    except Exception as e:  # noqa: BLE001 - raised by the attempt, after the deltas before it
        queue.put_nowait((_END, e))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _as_lost(error: BaseException | None, replica_id: str) -> BaseException:
    from deploy.replica.client import replica_gone  # imports Ray; only once a channel ended

    if error is not None and replica_gone(error):
        return error
    return WorkerUnavailableError(f"worker {replica_id} lost: its delta channel ended")


def _lost(start: StreamStart | None) -> str:
    replica = start.replica_id if start is not None else "?"
    return f"worker {replica} lost: its delta channel ended"

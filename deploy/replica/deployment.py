"""The worker deployment: one engine per Ray Serve replica (`EngineProcess`, its own child
process, docs/design.md §20; `AsyncEngine`, a thread of the replica, under tensor parallelism).

The class is plain Python (no Serve decorator) so tests drive it in-process with a fake engine;
`deploy.app` wraps it with `serve.deployment(...)`. Serve calls, besides `generate` and `deltas` (an ingress's delta channel,
`deploy/replica/channel.py`):

- `record_routing_stats()` every `request_routing_stats_period_s` (the controller): queue sizes
  and both pools' numbers, for the routers; the same sample goes to the deployment's index actor,
  where the ingress reads every replica's for `/metrics` and `/health` (`cluster.replica_stats`;
  a request's first tokens and its end mark a sample due, which rides on the next push of cache
  events: the request's end flushes them, else the pump's background flush within 0.25 s,
  `report_soon`);
- `check_health()` every `health_check_period_s`: raises when the engine is stuck or shut down,
  or when a tensor-parallel rank is gone (`EngineClient.error`, docs/design.md §17.4);
- `__del__` after Serve's graceful drain (no new requests are routed here and ongoing requests
  had up to `graceful_shutdown_timeout_s` to finish): aborts stragglers, stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.messages import (
    EngineDiedError,
    RoutedRequest,
    StatsDict,
    StreamStart,
    WorkerInfo,
    WorkerUnavailableError,
    routing_stats,
)
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.metrics import flatten_stats
from deploy.replica.channel import ChannelEnd, DeltaBatch, Moved, OnSocket, StreamKey, Subscribe
from deploy.replica.delta_socket import DeltaSender
from deploy.replica.heap import settle_heap
from deploy.replica.outbox import IDLE_S, Outbox
from worker.config import EngineConfig
from worker.engine.protocols import Divertible, EngineClient
from worker.errors import EngineGoneError
from worker.hosts.streams import merge_deltas

if TYPE_CHECKING:
    from ray.serve.context import ReplicaContext

    from deploy.replica.events import CacheEventPump

log = logging.getLogger("swaserve.worker")

EngineFactory = Callable[[EngineConfig], EngineClient]
UNREACHABLE_S = 300.0  # a delta socket not reached is not tried again for this long
REPLACE_WAIT_S = 10.0  # how long a resent request waits for its earlier attempt here to end


@dataclass(frozen=True)
class WorkerOptions:
    stall_timeout_s: float = 120.0  # pending work but no engine step for this long -> unhealthy
    publish_events: bool = True  # cache events to the index actor (only inside a Serve replica)
    event_interval_s: float = 0.25  # background flush period of cache events
    engine_process: bool = True  # step the engine in a child process (one rank; docs §20)
    engine_niceness: int | None = None  # that process's niceness (None: the replica's)
    channel_idle_s: float = IDLE_S  # an ingress's delta channel with no request here ends


def _default_engine(
    config: EngineConfig, own_process: bool = True, niceness: int | None = None
) -> EngineClient:
    """The engine of a replica: in a child process (`own_process`, one rank) or on a thread of
    the replica's process (tensor parallelism: the ranks are Ray actors the replica starts)."""
    if config.tensor_parallel_size > 1 and _replica_context() is not None:
        from deploy.replica.ranks import RayRankLauncher  # ranks in the replica's placement group
        from worker.hosts.async_engine import AsyncEngine

        return AsyncEngine(config, launcher=RayRankLauncher(current_replica_id()))
    if own_process and config.tensor_parallel_size == 1:
        from worker.hosts.engine_process import EngineProcess

        return EngineProcess(config, niceness=niceness)
    from worker.hosts.async_engine import AsyncEngine  # heavy (torch); only inside the replica

    return AsyncEngine(config)


def _replica_context() -> ReplicaContext | None:
    try:
        from ray import serve

        return serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


def current_replica_id() -> str:
    """Serve's short replica id inside a replica; `local-<pid>` outside Serve (tests)."""
    ctx = _replica_context()
    return ctx.replica_id.unique_id if ctx is not None else f"local-{os.getpid()}"


class WorkerDeployment:
    def __init__(
        self,
        engine_config: EngineConfig,
        options: WorkerOptions | None = None,
        engine_factory: EngineFactory | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id or current_replica_id()
        self._options = options or WorkerOptions()
        self._engine = (
            engine_factory(engine_config)
            if engine_factory is not None
            else _default_engine(
                engine_config, self._options.engine_process, self._options.engine_niceness
            )
        )
        self._events = self._event_pump()
        # request id -> set once its stream here ended and its engine request was closed
        self._inflight: dict[str, asyncio.Event] = {}
        self._outboxes: dict[str, Outbox] = {}  # ingress id -> its open delta channel
        self._unreachable: dict[tuple[str, int], float] = {}  # delta socket -> retry after
        self._by_ingress: dict[str, int] = {}  # ingress id -> its requests in flight here
        self._draining = False
        self._stopped = False
        self._progress = (0, time.monotonic())  # (engine steps, when they last changed)
        if _replica_context() is not None:  # the process is this replica's (not a test's)
            settle_heap()

    def _event_pump(self) -> CacheEventPump | None:
        ctx = _replica_context()
        if not self._options.publish_events or ctx is None:
            return None
        from deploy.replica.events import CacheEventPump

        return CacheEventPump(
            self._engine,
            self.replica_id,
            ctx.app_name,
            ctx.deployment,
            self._options.event_interval_s,
        )

    # -- requests --------------------------------------------------------------------------

    async def deltas(self, sub: Subscribe) -> AsyncGenerator[DeltaBatch | OnSocket, None]:
        """Ingress `sub.ingress_id`'s delta channel: one `DeltaBatch` per wake-up, until the
        ingress closes it, opens another, or this replica shuts down; on the ingress's delta
        socket when the subscription names one and it can be reached (then the call's one item
        is `OnSocket`). Refused (raises) on a replica other than the one it names (the router
        could not pin it: `router.pinned`)."""
        if sub.replica_id != self.replica_id or self._draining:
            raise WorkerUnavailableError(
                f"delta channel for worker {sub.replica_id} reached {self.replica_id}"
                + (" (shutting down)" if self._draining else "")
            )
        sender = await self._connect(sub)  # first: no request's deltas wait on the connect
        ingress = sub.ingress_id
        idle_s = self._options.channel_idle_s
        outbox = Outbox(sub.subscription, lambda: not self._by_ingress.get(ingress), idle_s)
        previous = self._outboxes.get(sub.ingress_id)
        if previous is not None:
            previous.close()  # the ingress gave it up: its requests fail there already
        self._outboxes[sub.ingress_id] = outbox
        try:
            if sender is None:
                async for batch in outbox.batches():
                    yield batch
            else:
                yield OnSocket()
                async for batch in outbox.batches():
                    await sender.send(batch.items)
                self._forget(sub.ingress_id, outbox)
                await sender.close()  # its last frame reaches the ingress before the call ends
        finally:
            self._forget(sub.ingress_id, outbox)
            if sender is not None:
                sender.abort()

    async def _connect(self, sub: Subscribe) -> DeltaSender | None:
        """The subscription's delta socket; None when it names none or cannot be reached (the
        batches then go on the call). An endpoint that could not be reached is not tried
        again for `UNREACHABLE_S`: behind a firewall that drops the connection, every channel
        would otherwise wait out the connect timeout before its first batch."""
        if sub.endpoint is None:
            return None
        now = time.monotonic()
        if self._unreachable.get(sub.endpoint, now) > now:
            return None
        try:
            return await DeltaSender.connect(sub.endpoint, sub.token)
        except (OSError, TimeoutError) as e:
            self._unreachable[sub.endpoint] = now + UNREACHABLE_S
            log.warning("delta socket %s:%d of ingress %s not reached (%s): its channels' deltas "
                        "go on their calls for %.0f s", *sub.endpoint, sub.ingress_id[:8], e,
                        UNREACHABLE_S)  # fmt: skip
            return None

    def _forget(self, ingress: str, outbox: Outbox) -> None:
        outbox.close()
        if self._outboxes.get(ingress) is outbox:
            del self._outboxes[ingress]

    async def generate(
        self, request: RoutedRequest, key: StreamKey | None = None
    ) -> AsyncGenerator[StreamStart | StreamDelta | ChannelEnd | Moved, None]:
        """Stream one prompt: a `StreamStart`, then coalesced `StreamDelta`s until every choice
        finished (each delta's `request_id` names its choice, `RoutedRequest.choice_ids`).

        With a `key` whose ingress has a channel open here, the `StreamStart` (naming the
        channel) and the deltas go to that channel instead, each under `key.nonce`, and this
        stream sends nothing unless it raises, when `ChannelEnd` (how many deltas went there,
        and where) goes first: Ray reports each item on its own, at ~1 ms of CPU a side. A
        request that started inline moves to its ingress's channel once there is one (`Moved`).

        The request's add is its validation (`EngineClient.generate`): the `StreamStart` goes
        out with the first deltas, or as the refusal when the engine refused the add. Cancelling
        the caller (client disconnect, stop string at the ingress) closes the engine streams
        here, and the engine aborts the requests.
        """
        token_ids = list(request.token_ids)
        params = request.params if request.params is not None else SamplingParams()
        choices = list(zip(request.choice_ids, (params, *request.sibling_params)))
        refusal = self._refusal()
        if refusal is not None:
            yield refusal
            return
        if self._events is not None:
            await self._events.ensure_started()
        if key is not None:  # counted before its outbox is looked up: none ends idle under it
            self._by_ingress[key.ingress_id] = self._by_ingress.get(key.ingress_id, 0) + 1
        try:
            # aclosing: a cancelled caller must close the engine streams now (the abort)
            async with contextlib.aclosing(self._generate(request, token_ids, choices, key)) as items:
                async for item in items:
                    yield item
        finally:
            if key is not None:
                self._left(key.ingress_id)

    def _channel_of(self, key: StreamKey) -> Outbox | None:
        """The open channel of the key's ingress on this replica, if any."""
        outbox = self._outboxes.get(key.ingress_id)
        return None if outbox is None or outbox.closed else outbox

    def _left(self, ingress: str) -> None:
        left = self._by_ingress.pop(ingress) - 1
        if left:
            self._by_ingress[ingress] = left
        elif (outbox := self._outboxes.get(ingress)) is not None:
            outbox.wake()  # idle now: it may end

    async def _generate(
        self,
        request: RoutedRequest,
        token_ids: list[int],
        choices: list[tuple[str, SamplingParams]],
        key: StreamKey | None,
    ) -> AsyncGenerator[StreamStart | StreamDelta | ChannelEnd | Moved, None]:
        ids = [cid for cid, _ in choices]
        streams = _SingleChoice(self, token_ids, *choices[0]) if len(choices) == 1 else _Choices(
            self, token_ids, choices
        )
        open_ids = set(ids)
        await self._replace_earlier(ids)
        done = asyncio.Event()
        self._inflight.update(dict.fromkeys(ids, done))
        try:
            try:
                batch = await streams.next()
            except ValueError as e:  # the add refused it: it can never run
                yield StreamStart(self.replica_id, "invalid", str(e))
                return
            except WorkerUnavailableError as e:
                if isinstance(e, EngineDiedError) or self._engine.error is None:
                    yield StreamStart(self.replica_id)  # it was running here: as before
                    raise
                yield StreamStart(self.replica_id, "unavailable", "worker engine failed; retry")
                return
            except Exception:
                yield StreamStart(self.replica_id)
                raise
            outbox = self._channel_of(key) if key is not None else None
            if outbox is None:  # none, or ending (idle): inline
                yield StreamStart(self.replica_id)
                deltas = self._deltas(streams, batch, open_ids)
                async for delta in deltas:
                    yield delta
                    if open_ids and key is not None and (outbox := self._channel_of(key)) is not None:
                        break  # its ingress has a channel here now: the rest goes there
                else:
                    return
                assert outbox is not None and key is not None
                yield Moved(outbox.subscription)
                moved = 0
                try:
                    async for delta in deltas:
                        outbox.put(key.nonce, delta)
                        moved += 1
                except Exception:
                    yield ChannelEnd(moved, outbox.subscription)  # raised there after the deltas before it
                    raise
                return
            assert key is not None
            nonce = key.nonce
            # The StreamStart goes first on the channel, ahead of the deltas: while it runs well
            # this call yields nothing (a Serve stream item costs each side ~1 ms of CPU).
            outbox.put(nonce, StreamStart(self.replica_id, channel=outbox.subscription))
            sent = 0

            def put(delta: StreamDelta) -> bool:  # the engine host's diverted deltas
                nonlocal sent
                if outbox.closed:
                    return False  # queued for the relay instead, which raises at its put below
                outbox.put(nonce, delta)
                sent += 1
                return True

            single = streams if isinstance(streams, _SingleChoice) else None  # n > 1: pumps
            try:
                async for delta in self._deltas(streams, batch, open_ids):
                    outbox.put(nonce, delta)
                    sent += 1
                    if single is not None:  # after the first batch: those queued since follow it
                        single.divert(put)
                        single = None
            except Exception:
                yield ChannelEnd(sent, outbox.subscription)  # raised there after the deltas before it
                raise
            # Every choice's final delta is on the channel: the stream's end says the rest.
        finally:
            try:
                await streams.close()
            finally:
                for cid in ids:
                    if self._inflight.get(cid) is done:
                        del self._inflight[cid]
                done.set()

    async def _replace_earlier(self, ids: list[str]) -> None:
        """A request sent again (before its first token, its replica lost to the ingress: a
        failed channel) can reach this replica before the cancel of its earlier attempt here
        does; the engine would refuse it as a duplicate (a 400 for the client). Request ids
        are the ingress's, one per HTTP request, so the earlier attempt has no reader left:
        abort it and wait for its stream to close (its abort reaches the engine before the new
        add does)."""
        earlier = {cid: self._inflight[cid] for cid in ids if cid in self._inflight}
        if not earlier:
            return
        for cid in earlier:
            self._engine.abort(cid)
        log.info("worker %s: %s sent again while its earlier attempt ran here; aborted it",
                 self.replica_id, ids[0])  # fmt: skip
        try:
            async with asyncio.timeout(REPLACE_WAIT_S):
                for event in set(earlier.values()):
                    await event.wait()
        except TimeoutError:
            pass  # the add below refuses it as a duplicate, as without the wait

    async def _deltas(
        self, streams: _SingleChoice | _Choices, batch: list[StreamDelta], open_ids: set[str]
    ) -> AsyncGenerator[StreamDelta, None]:
        """The request's deltas from its first `batch` on, until every choice finished."""
        reported = False
        while True:
            for delta in batch:
                if delta.finished:
                    open_ids.discard(delta.request_id)
                if (not reported or not open_ids) and self._events is not None:
                    self._events.report_soon(self._stats_sample)  # rides on the next flush
                    reported = True
                if not open_ids and self._events is not None:
                    # The cache these requests leave behind reaches the index before the
                    # client hears back, so a follow-up is routed with it (and the stats).
                    await self._events.flush()
                yield delta
            if not open_ids:
                return
            batch = await streams.next()

    def _failure(self, rid: str, e: Exception) -> Exception:
        """What the ingress hears of the engine's stream of `rid` raising `e`."""
        if isinstance(e, EngineGoneError):
            return self._engine_gone(rid, e)
        if isinstance(e, ValueError) or self._engine.error is None:
            return e  # a refused add; or the engine's own error, the request's
        return WorkerUnavailableError(f"worker {self.replica_id}: its engine failed; retry")

    def _check_delta(self, delta: StreamDelta) -> None:
        """An abort the caller did not ask for is a shutdown (a caller that cancels is gone
        and never sees this)."""
        if delta.finish_reason == "abort" and not delta.error:
            raise WorkerUnavailableError(
                f"request {delta.request_id} was aborted on worker {self.replica_id}; retry"
            )

    def _ended_early(self, rid: str) -> WorkerUnavailableError:
        return WorkerUnavailableError(f"request {rid} was aborted on worker {self.replica_id}; retry")

    def _engine_gone(self, rid: str, e: EngineGoneError) -> WorkerUnavailableError:
        """The engine ended under request `rid`: stopped by a shutdown (not the request's
        doing), or died running it — maybe because of it, so the ingress sends it elsewhere at
        most once more (`EngineDiedError`). The engine's reason stays in this replica's log."""
        if self._draining:
            return WorkerUnavailableError(f"worker {self.replica_id} is shutting down; retry")
        log.warning("worker %s: the engine died while running %s: %s", self.replica_id, rid, e)
        return EngineDiedError(f"worker {self.replica_id}: its engine died while running the request")

    def _refusal(self) -> StreamStart | None:
        """Refused before the add: this replica is draining, or its engine has failed."""
        if self._draining:
            return StreamStart(
                self.replica_id, "unavailable", "worker replica is shutting down; retry"
            )
        if self._engine.error is not None:  # Serve replaces us at the next health check
            return StreamStart(self.replica_id, "unavailable", "worker engine failed; retry")
        return None

    # -- control plane ---------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            replica_id=self.replica_id,
            max_model_len=int(self._engine.max_model_len),
            model_dir=str(self._engine.model_dir),
            page_size=int(self._engine.config.page_size),
        )

    async def record_routing_stats(self) -> StatsDict:
        """`cluster.messages.routing_stats` (the router's contract) plus every engine number for
        `/metrics`; all values are flat numbers except `worker_id`. Serve calls this on RUNNING
        replicas only, so it also (re)registers the replica with the index actor's stats board."""
        if self._events is not None:
            try:
                await self._events.ensure_started()
            except Exception:  # noqa: BLE001 - the routers' stats must not depend on the index actor
                log.exception("registering with the cache index failed; retrying next time")
        return self._report_stats()

    def _report_stats(self) -> StatsDict:
        """A fresh sample, also sent to the index actor as a registering report (Serve's poll;
        the per-request reports go through `CacheEventPump.report_soon`)."""
        sample = self._stats_sample()
        if self._events is not None:
            self._events.report_stats(sample, register=True)
        return sample

    def _stats_sample(self) -> StatsDict:
        s = self._engine.stats()  # plain reads: no wait for the engine's step
        out = routing_stats(s, self.replica_id, time.time())
        out.update(flatten_stats(s))
        out["inflight"] = float(len(self._inflight))
        out["draining"] = 1.0 if self._draining else 0.0
        out["pid"] = float(
            os.getpid()
        )  # which process serves this replica (operators, fault tests)
        return out

    def check_health(self) -> None:
        if self._draining:
            return  # Serve is stopping us; do not get replaced mid-drain
        error = self._engine.error
        if error is not None:
            raise RuntimeError(f"engine failed (step thread or a tensor-parallel rank): {error!r}")
        s = self._engine.stats()
        steps, since = self._progress
        now = time.monotonic()
        if s.steps != steps or (s.waiting + s.running) == 0:
            self._progress = (s.steps, now)
        elif now - since > self._options.stall_timeout_s:
            raise RuntimeError(
                f"engine made no step in {now - since:.0f}s with {s.waiting} waiting and "
                f"{s.running} running requests (stall_timeout_s={self._options.stall_timeout_s})"
            )

    async def flush_cache(self) -> bool:
        """Empty the radix cache when idle (False while requests run); for tests and benches."""
        flushed = bool(await asyncio.to_thread(self._engine.flush_cache))
        if self._events is not None:
            await self._events.flush()
        return flushed

    async def check_integrity(self) -> None:
        # Both run on the engine's step thread between steps; wait for them off the event loop.
        await asyncio.to_thread(self._engine.check_integrity)

    def shutdown(self) -> None:
        """Stop taking requests, abort what is left, stop the engine (idempotent)."""
        if self._stopped:
            return
        self._draining = self._stopped = True
        for outbox in self._outboxes.values():
            outbox.close()
        for rid in list(self._inflight):  # (a copy: the aborts end streams)
            self._engine.abort(rid)
        log.info("worker %s shutting down (%d aborted)", self.replica_id, len(self._inflight))
        if self._events is not None:
            self._events.close()
        self._engine.shutdown()

    def __del__(self) -> None:
        # Serve calls this after its graceful drain; also runs when a test drops the object.
        if getattr(self, "_engine", None) is not None:
            self.shutdown()



class _SingleChoice:
    """The engine stream of a one-choice request, read in the replica's own call (no task
    and no queue between the engine's host and Serve's stream: its relay already merges what
    queued up between reads)."""

    def __init__(self, w: WorkerDeployment, token_ids: list[int], rid: str, params: SamplingParams) -> None:
        self._w, self._rid = w, rid
        self._gen = w._engine.generate(token_ids, params, rid, None)

    async def next(self) -> list[StreamDelta]:
        try:
            delta = await anext(self._gen, None)
        except Exception as e:  # noqa: BLE001 - mapped for the ingress
            failure = self._w._failure(self._rid, e)
            if failure is e:
                raise
            raise failure from e
        if delta is None:
            raise self._w._ended_early(self._rid)
        self._w._check_delta(delta)
        return [delta]

    def divert(self, to: Callable[[StreamDelta], bool]) -> None:
        """From now on the stream's unfinished deltas go to `to` as the engine host routes them
        (no wake-up here per step: `next` returns the last delta, or raises the end); hosts
        that cannot, and a stream whose end is already queued, go on as before."""
        engine = self._w._engine
        if isinstance(engine, Divertible):
            engine.divert(self._rid, to)

    async def close(self) -> None:
        await self._gen.aclose()


_Item = tuple[str, "StreamDelta | BaseException | None"]  # (choice id, delta | error | None: ended)


class _Choices:
    """The engine streams of a request's choices (n, best_of), each pumped by a task into one
    queue; the siblings follow the first into the engine."""

    def __init__(
        self, w: WorkerDeployment, token_ids: list[int], choices: list[tuple[str, SamplingParams]]
    ) -> None:
        self._w = w
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        first = choices[0][0]
        self._pumps = [
            asyncio.create_task(self._pump(token_ids, p, cid, None if cid == first else first))
            for cid, p in choices
        ]

    async def _pump(
        self, token_ids: list[int], params: SamplingParams, rid: str, follows: str | None
    ) -> None:
        gen = self._w._engine.generate(token_ids, params, rid, follows)
        try:
            async for delta in gen:
                self._queue.put_nowait((rid, delta))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer, raised there
            self._queue.put_nowait((rid, self._w._failure(rid, e)))
        finally:
            self._queue.put_nowait((rid, None))
            await gen.aclose()

    async def next(self) -> list[StreamDelta]:
        """Everything queued since the last call, merged per choice. Raises what the engine
        raised (a refused add: its ValueError), or `WorkerUnavailableError` when a request was
        aborted here rather than by the caller."""
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        errors = [item for _, item in batch if isinstance(item, BaseException)]
        if errors:
            raise errors[0]
        per_choice: dict[str, list[StreamDelta]] = {}
        for cid, item in batch:
            if isinstance(item, StreamDelta):
                per_choice.setdefault(cid, []).append(item)
        merged = {cid: merge_deltas(ds) for cid, ds in per_choice.items()}
        for cid, item in batch:
            delta = merged.get(cid)
            if item is None and not (delta and delta.finished):
                raise self._w._ended_early(cid)
        for delta in merged.values():
            self._w._check_delta(delta)
        return list(merged.values())

    async def close(self) -> None:
        live = [p for p in self._pumps if not p.done()]
        for p in live:
            p.cancel()
        await asyncio.gather(*live, return_exceptions=True)


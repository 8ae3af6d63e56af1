"""1,024 concurrent requests through the worker replica's batched path, in-process: an engine
host that emits one list of every running request's deltas per step (as the engine process's
step message does), routed into the streams by `StreamingHost._route`, merged by the relay and
streamed by `WorkerDeployment.generate` (one-choice requests read in the call itself, n=2 ones
through the choices' pumps), and, as an ingress receives them, on the delta channel
(`deploy/replica/channels.py`), one-choice streams' deltas diverted by the host straight to
the channel's outbox (`DeltaQueue.divert`). Every token of every stream must equal the engine's record, in
order, each choice ending once with its finished delta: no delta lost, duplicated or
reordered."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cluster.messages import RoutedRequest, StreamStart
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.replica.channel import DeltaBatch, OnSocket, StreamKey, Subscribe
from deploy.replica.channels import Channels
from deploy.replica.delta_socket import DeltaListener
from deploy.replica.deployment import WorkerDeployment
from tests.fakes.fake_engine import FakeEngine
from worker.config import EngineConfig
from worker.hosts.streams import DeltaQueue, StreamingHost

REQUESTS = 1024


class StepHost(FakeEngine, StreamingHost):
    """A step thread that, each step, gives every running request one token and routes the
    whole step's deltas at once; `record` is what it emitted per request, in order."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._streams = {}
        self._running: dict[str, tuple[int, int]] = {}  # request id -> (last token, tokens left)
        self.record: dict[str, list[int]] = {}
        self.diverted = 0  # streams whose unfinished deltas went straight to a channel's outbox
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._steps, daemon=True)
        self._thread.start()

    def generate(
        self, token_ids: list[int], params: SamplingParams, request_id: str, follows: str | None = None
    ) -> Any:
        async def start(_: DeltaQueue) -> None:
            self.validate(token_ids, params)  # the add is the check
            with self._lock:
                self._running[request_id] = (token_ids[-1] + (params.seed or 0), params.max_tokens)
                self.record[request_id] = []

        return self._relay(request_id, start)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._running.pop(request_id, None)

    def divert(self, request_id: str, to: Callable[[StreamDelta], bool]) -> bool:
        diverted = super().divert(request_id, to)
        self.diverted += diverted
        return diverted

    def _check_alive(self) -> None:
        pass

    def _steps(self) -> None:
        while not self._stop.is_set():
            deltas = []
            with self._lock:
                for rid, (last, left) in list(self._running.items()):
                    tok = (last * 31 + 7) % 50_000
                    self.record[rid].append(tok)
                    done = left == 1
                    n = len(self.record[rid])
                    deltas.append(StreamDelta(rid, [tok], done, "length" if done else None, 3, 0, n))
                    if done:
                        del self._running[rid]
                    else:
                        self._running[rid] = (tok, left - 1)
            if deltas:
                self._route(deltas)
            else:
                self._stop.wait(0.001)  # idle: nothing to step

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(10)
        super().shutdown()


def _request(i: int) -> RoutedRequest:
    params = SamplingParams(max_tokens=1 + i % 37, seed=i)
    siblings = (SamplingParams(max_tokens=1 + i % 11, seed=i + 7),) if i % 8 == 0 else ()
    return RoutedRequest([1 + i % 200, 2, 3], f"req-{i}", params=params, sibling_params=siblings)


@pytest.mark.parametrize(("channel", "socket"), [(True, True), (True, False), (False, False)],
                         ids=["socket", "channel", "inline"])  # fmt: skip
def test_1024_concurrent_streams_lose_and_reorder_no_delta(channel: bool, socket: bool) -> None:
    """`channel`: every stream's deltas travel on the ingress's delta channel to the replica
    (`Channels`, `WorkerDeployment.deltas`: one batch per wake-up for all of them), ordered
    with the request streams by the ingress, the batches on a loopback delta socket with
    `socket` (`deploy/replica/delta_socket.py`), else on the channel's call; else on each
    request's own stream (a replica the ingress has no channel to yet)."""
    host = StepHost(EngineConfig(page_size=4, max_model_len=4096))
    w = WorkerDeployment(EngineConfig(page_size=4, max_model_len=4096), engine_factory=lambda _: host,
                         replica_id="r1")  # fmt: skip
    requests = [_request(i) for i in range(REQUESTS)]
    on_channel: list[str] = []  # request ids whose StreamStart named a channel
    carried: list[object] = []  # what the channel's call itself carried
    call_items: list[object] = []  # what the requests' own calls carried

    async def subscribe(sub: Subscribe) -> AsyncIterator[DeltaBatch | OnSocket]:
        async for item in w.deltas(sub):
            carried.append(item)
            yield item

    def call(req: RoutedRequest) -> Callable[[StreamKey], AsyncIterator[Any]]:
        async def items(key: StreamKey) -> AsyncIterator[Any]:
            async for item in w.generate(req, key):
                call_items.append(item)
                yield item

        return items

    async def one(channels: Channels, req: RoutedRequest) -> list[Any]:
        if not channel:
            return [item async for item in w.generate(req)]
        items = [item async for item in channels.attempt(req, call(req))]
        if isinstance(items[0], StreamStart) and items[0].channel is not None:
            on_channel.append(req.request_id)
        return items

    async def every() -> list[list[Any]]:
        listener = DeltaListener(lambda: "127.0.0.1") if socket else None
        channels = Channels(subscribe, listener=listener)
        if channel:  # a first request opens the channel; then wait until the replica has it
            await one(channels, RoutedRequest([1, 2, 3], "warm", params=SamplingParams(max_tokens=1)))
            for _ in range(10_000):
                if channels.ingress_id in w._outboxes:
                    break
                await asyncio.sleep(0)  # a turn of the loop (bounded count), no clock
        streams = await asyncio.wait_for(asyncio.gather(*(one(channels, r) for r in requests)), 300)
        await channels.close()
        return streams

    try:
        streams = asyncio.run(every())
    finally:
        w.shutdown()
    assert sorted(on_channel) == (sorted(r.request_id for r in requests) if channel else [])
    # on a channel, a request's call carries nothing (its StreamStart leads its deltas there)
    # but the warm-up's inline items: StreamStart and one delta
    assert len(call_items) == 2 if channel else not call_items
    # one-choice streams on the channel hand their deltas over from the host (those whose last
    # delta was queued before the handover cannot); none does without a channel
    assert (host.diverted > 0) == channel
    if channel:  # the batches came over the socket, or over the call
        assert (carried == [OnSocket()]) if socket else all(isinstance(b, DeltaBatch) for b in carried)
    for req, items in zip(requests, streams):
        assert isinstance(items[0], StreamStart) and items[0].replica_id == "r1" and items[0].refusal is None
        got: dict[str, list[int]] = {cid: [] for cid in req.choice_ids}
        for delta in items[1:]:
            assert isinstance(delta, StreamDelta) and not got[delta.request_id][-1:] == [None]
            got[delta.request_id].extend(delta.token_ids)
            assert delta.completion_tokens == len(got[delta.request_id])
            if delta.finished:
                got[delta.request_id].append(None)  # type: ignore[arg-type]  # the end mark
        params = [req.params, *req.sibling_params]
        for cid, p in zip(req.choice_ids, params):
            assert p is not None
            assert got[cid] == [*host.record[cid], None], cid
            assert len(host.record[cid]) == p.max_tokens


def test_a_diverted_queue_hands_over_in_order_and_gives_back_the_end() -> None:
    """Deltas queued before the handover go first; a refused one and everything after it, and
    the last delta, stay queued for the relay, in order."""

    def delta(n: int, finished: bool = False) -> StreamDelta:
        return StreamDelta("r", [n], finished, "length" if finished else None, 3, 0, n)

    async def main() -> None:
        q = DeltaQueue()
        q.put_nowait(delta(1))
        q.put_nowait(delta(2))
        taken: list[int] = []

        def take(d: StreamDelta, offset: int = 0) -> bool:
            if d.token_ids[0] == 5:
                return False  # refused
            taken.append(offset + d.token_ids[0])
            return True

        assert q.divert(take)
        assert taken == [1, 2] and q.empty()
        q.put_nowait(delta(3))
        q.put_nowait(delta(4))
        assert taken == [1, 2, 3, 4] and q.empty()
        q.put_nowait(delta(5))  # refused (its channel closed): queued, and so is the rest
        q.put_nowait(delta(6))
        q.put_nowait(delta(7, finished=True))
        assert taken == [1, 2, 3, 4]
        assert [q.get_nowait().token_ids[0] for _ in range(3)] == [5, 6, 7]  # type: ignore[union-attr]

        q2 = DeltaQueue()
        q2.put_nowait(delta(1))
        q2.put_nowait(delta(2, finished=True))  # the end is already queued: no handover
        assert not q2.divert(lambda d: take(d, 100))
        assert taken[-1] == 101  # the one before the end went over
        assert q2.get_nowait().finished and q2.empty()  # type: ignore[union-attr]
        q2.put_nowait(delta(3))  # not diverted: queued
        assert q2.qsize() == 1

    asyncio.run(main())

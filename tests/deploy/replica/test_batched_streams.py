"""1,024 concurrent requests through the worker replica's batched path, in-process: an engine
host that emits one list of every running request's deltas per step (as the engine process's
step message does), routed into the streams by `StreamingHost._route`, merged by the relay and
streamed by `WorkerDeployment.generate` (one-choice requests read in the call itself, n=2 ones
through the choices' pumps), and, as an ingress receives them, on the delta channel
(`deploy/replica/channels.py`). Every token of every stream must equal the engine's record, in
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
from deploy.replica.channel import OnChannel, StreamKey
from deploy.replica.channels import Channels
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


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "inline"])
def test_1024_concurrent_streams_lose_and_reorder_no_delta(channel: bool) -> None:
    """`channel`: every stream's deltas travel on the ingress's delta channel to the replica
    (`Channels`, `WorkerDeployment.deltas`: one batch per wake-up for all of them), ordered
    with the request streams by the ingress; else on each request's own stream (a replica
    the ingress has no channel to yet)."""
    host = StepHost(EngineConfig(page_size=4, max_model_len=4096))
    w = WorkerDeployment(EngineConfig(page_size=4, max_model_len=4096), engine_factory=lambda _: host,
                         replica_id="r1")  # fmt: skip
    requests = [_request(i) for i in range(REQUESTS)]
    on_channel: list[str] = []  # request ids whose request stream said OnChannel

    def call(req: RoutedRequest) -> Callable[[StreamKey], AsyncIterator[Any]]:
        async def items(key: StreamKey) -> AsyncIterator[Any]:
            async for item in w.generate(req, key):
                if isinstance(item, OnChannel):
                    on_channel.append(req.request_id)
                yield item

        return items

    async def one(channels: Channels, req: RoutedRequest) -> list[Any]:
        if not channel:
            return [item async for item in w.generate(req)]
        return [item async for item in channels.attempt(req, call(req))]

    async def every() -> list[list[Any]]:
        channels = Channels(w.deltas)
        if channel:  # a first request opens the channel; then wait until the replica has it
            await one(channels, RoutedRequest([1, 2, 3], "warm", params=SamplingParams(max_tokens=1)))
            for _ in range(10_000):
                if channels.ingress_id in w._outboxes:
                    break
                await asyncio.sleep(0)
        streams = await asyncio.wait_for(asyncio.gather(*(one(channels, r) for r in requests)), 300)
        await channels.close()
        return streams

    try:
        streams = asyncio.run(every())
    finally:
        w.shutdown()
    assert sorted(on_channel) == (sorted(r.request_id for r in requests) if channel else [])
    for req, items in zip(requests, streams):
        assert items[0] == StreamStart("r1")
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

"""The worker deployment class in-process (no Ray): refusals, streams, stats, health, drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.messages import EngineDiedError, RoutedRequest, StreamStart, WorkerUnavailableError
from core.sampling_params import SamplingParams
from deploy.replica.deployment import WorkerDeployment, WorkerOptions
from tests.fakes.fake_engine import FakeEngine
from worker.config import EngineConfig


def _worker(**kw: Any) -> tuple[WorkerDeployment, FakeEngine]:
    engines: list[FakeEngine] = []

    def factory(cfg: EngineConfig) -> FakeEngine:
        engines.append(FakeEngine(cfg, step_s=0.002))
        return engines[-1]

    w = WorkerDeployment(EngineConfig(page_size=4, max_model_len=64), engine_factory=factory, replica_id="r1", **kw)
    return w, engines[0]


async def _collect(w: WorkerDeployment, req: RoutedRequest) -> list[Any]:
    return [item async for item in w.generate(req)]


def test_worker_refuses_invalid_and_draining() -> None:
    """Invalid requests (refused by the engine's add: no separate validation) and requests
    during drain get a refusing StreamStart and nothing else."""
    w, _ = _worker()
    too_long = asyncio.run(_collect(w, RoutedRequest([1] * 60, "a", params=SamplingParams(max_tokens=10))))
    assert too_long == [StreamStart("r1", "invalid", too_long[0].message)] and "max_model_len" in too_long[0].message
    w.shutdown()
    drained = asyncio.run(_collect(w, RoutedRequest([1, 2], "b", params=SamplingParams(max_tokens=2))))
    assert drained[0].refusal == "unavailable" and len(drained) == 1


def test_worker_stream_and_routing_stats() -> None:
    """A stream is StreamStart then deltas summing to max_tokens; routing stats follow cluster.messages.routing_stats."""
    from cluster.messages import WorkerLoad

    w, engine = _worker()
    items = asyncio.run(_collect(w, RoutedRequest([1, 2, 3], "a", params=SamplingParams(max_tokens=7, temperature=0))))
    assert items[0] == StreamStart("r1")
    assert sum(len(d.token_ids) for d in items[1:]) == 7 and items[-1].finished
    stats = asyncio.run(w.record_routing_stats())
    load = WorkerLoad.from_routing_stats(stats)
    assert load is not None and load.worker_id == "r1" and load.full.total == engine.stats().full.total
    assert stats["full_peak_used_tokens"] > 0 and stats["swa_total_tokens"] > 0


def test_worker_streams_every_choice_of_a_prompt() -> None:
    """A request with sibling choices streams all of them on one stream (each delta names its
    choice), the siblings follow the first into the engine, and it ends when all finished."""
    w, engine = _worker()
    first = SamplingParams(max_tokens=3, seed=1)
    req = RoutedRequest([1, 2, 3], "p", params=first, sibling_params=(SamplingParams(max_tokens=5, seed=2),))
    items = asyncio.run(_collect(w, req))
    assert items[0] == StreamStart("r1") and req.choice_ids == ["p", "p/1"]
    tokens: dict[str, int] = {}
    for d in items[1:]:
        tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.token_ids)
    assert tokens == {"p": 3, "p/1": 5} and {d.request_id for d in items[1:] if d.finished} == {"p", "p/1"}
    assert [(rid, follows) for rid, _, follows in engine.seen] == [("p", None), ("p/1", "p")]
    assert engine.stats().full.used == 0


def test_health_check_flags_a_stalled_engine() -> None:
    """check_health raises when work is pending but the engine step counter stops moving."""
    w, engine = _worker(options=WorkerOptions(stall_timeout_s=0.05))
    w.check_health()  # idle: healthy
    engine._held["stuck"] = 3  # a running request that never advances
    w.check_health()
    steps, since = w._progress
    w._progress = (steps, since - 1.0)  # the last step was a second ago, past the 0.05 s limit
    with pytest.raises(RuntimeError, match="no step"):
        w.check_health()


def test_shutdown_aborts_inflight_and_stops_engine() -> None:
    """After Serve's drain, shutdown aborts what still runs (its KV freed) and stops the engine."""
    w, engine = _worker()

    async def go() -> tuple[int, list[Any]]:
        gen = w.generate(RoutedRequest([1, 2, 3], "long", params=SamplingParams(max_tokens=50)))
        items = [await gen.__anext__(), await gen.__anext__()]
        held = engine.stats().full.used
        w.shutdown()
        with pytest.raises(WorkerUnavailableError, match="aborted"):
            items.extend([item async for item in gen])
        return held, items

    held, items = asyncio.run(asyncio.wait_for(go(), 10))
    assert held > 0 and engine.stats().full.used == 0 and engine.shut_down
    assert isinstance(items[0], StreamStart) and not items[1].finished


def _dies_after_one(engine: FakeEngine, before: Any = None) -> None:
    """The engine dies under its requests after their first delta (`EngineGoneError`), after
    calling `before` if given."""
    from worker.errors import EngineGoneError

    real = engine.generate

    async def dies_after_one(*args: Any, **kw: Any) -> Any:
        async for delta in real(*args, **kw):
            yield delta
            if before is not None:
                before()
            engine.error = RuntimeError("the engine process is gone (exit code -9)")
            raise EngineGoneError("engine stopped: the engine process is gone (exit code -9)")

    engine.generate = dies_after_one  # type: ignore[method-assign]


def test_an_engine_gone_mid_stream_is_a_death_to_the_ingress() -> None:
    """The engine dying under a request (`EngineGoneError`) reaches the ingress as
    `EngineDiedError`, a lost replica it sends elsewhere at most once more (the request may be
    why), not as the request's error; the engine's own words stay in this replica's log."""
    w, engine = _worker()
    _dies_after_one(engine)
    req = RoutedRequest([1, 2, 3], "a", params=SamplingParams(max_tokens=50, temperature=0))
    with pytest.raises(EngineDiedError, match="engine died while running the request") as err:
        asyncio.run(_collect(w, req))
    assert "exit code" not in str(err.value)


def test_an_engine_stopped_by_a_shutdown_is_no_death() -> None:
    """Draining, the engine ending under a request is the shutdown's doing: a plain
    `WorkerUnavailableError` (resent as before, not counted against the request)."""
    w, engine = _worker()
    _dies_after_one(engine, before=lambda: setattr(w, "_draining", True))  # Serve stops it
    req = RoutedRequest([1, 2, 3], "a", params=SamplingParams(max_tokens=50, temperature=0))
    with pytest.raises(WorkerUnavailableError) as err:
        asyncio.run(_collect(w, req))
    assert not isinstance(err.value, EngineDiedError)


def test_an_engine_found_dead_on_arrival_is_a_refusal_not_an_error() -> None:
    """The engine died before the request reached it, and the add raises something other than
    ValueError (the connection is gone): an `unavailable` refusal (503), not a 500."""
    w, engine = _worker()

    def gone(*_: Any) -> None:
        engine.error = RuntimeError("the engine process is gone")
        raise BrokenPipeError("the connection to the engine process is closed")

    engine.validate = gone  # type: ignore[method-assign]  # the fake's add checks with it
    items = asyncio.run(_collect(w, RoutedRequest([1, 2], "a", params=SamplingParams(max_tokens=2))))
    assert items == [StreamStart("r1", "unavailable", "worker engine failed; retry")]


def test_a_refused_add_of_a_request_with_choices_is_one_refusal() -> None:
    """n=2 of a prompt that can never run: the choices' adds are refused, the stream is the
    refusing StreamStart alone, and nothing is left running or held."""
    w, engine = _worker()
    req = RoutedRequest([1] * 60, "p", params=SamplingParams(max_tokens=10, seed=1),
                        sibling_params=(SamplingParams(max_tokens=10, seed=2),))  # fmt: skip
    items = asyncio.run(_collect(w, req))
    assert len(items) == 1 and items[0].refusal == "invalid" and "max_model_len" in items[0].message
    assert not w._inflight and engine.stats().full.used == 0


def test_a_request_sent_again_before_its_earlier_attempt_ended_here_replaces_it() -> None:
    """The ingress sent a request again (its channel failed before the first token) and the
    new attempt reached this replica before the earlier one's cancel: the earlier attempt is
    aborted and the new one streams whole, instead of the engine refusing a duplicate id (a
    400 for the client)."""

    async def run() -> None:
        w, engine = _worker()
        req = RoutedRequest([1, 2, 3], "x", params=SamplingParams(max_tokens=40, ignore_eos=True))
        earlier: list[Any] = []

        async def serve_earlier() -> None:  # Serve keeps pulling the items nobody reads now
            try:
                async for item in w.generate(req):
                    earlier.append(item)
            except WorkerUnavailableError:
                earlier.append("aborted")

        task = asyncio.ensure_future(serve_earlier())
        for _ in range(10_000):  # turns of the loop (bounded count), no clock
            if len(earlier) >= 3:
                break
            await asyncio.sleep(0)
        assert len(earlier) >= 3 and earlier[0] == StreamStart("r1")
        again = await _collect(w, req)
        assert again[0] == StreamStart("r1")  # not a refusal
        assert sum(len(d.token_ids) for d in again[1:]) == 40 and again[-1].finished
        await task
        assert earlier[-1] == "aborted" or not earlier[-1].finished
        assert not w._inflight and engine.stats().full.used == 0
        w.shutdown()

    asyncio.run(run())

"""`EngineProcess` (docs/design.md §20): the engine in a child process, behind the same
`EngineClient` as `AsyncEngine` — streams equal the offline engine's greedy tokens, a closed
stream aborts and frees its KV, a refused add raises its ValueError, calls run between steps, and a
child that dies ends every open stream with `EngineGoneError` and fails every call instead of
hanging them; the child runs at the niceness asked, or keeps its own when it may not lower it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.events import EventKind, replay
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, tokens
from worker.config import EngineConfig
from worker.errors import EngineGoneError
from worker.hosts import engine_process
from worker.hosts.engine_process import EngineProcess

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# above this process's niceness: raising it needs no privilege (lowering it would)
NICENESS = min(os.getpriority(os.PRIO_PROCESS, 0) + 2, 19)


@pytest.fixture(scope="module")
def engine(oracle: Oracle) -> Iterator[EngineProcess]:
    cfg = EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048,
                       swa_full_tokens_ratio=0.25, chunked_prefill_size=32, swa_eviction_interval=8)  # fmt: skip
    ep = EngineProcess(cfg, niceness=NICENESS)
    try:
        yield ep
    finally:
        ep.shutdown()
    assert ep._proc.returncode == 0


def _wait_idle(engine: EngineProcess) -> None:
    deadline = time.monotonic() + 30
    while (s := engine.stats()).running or s.waiting:
        assert time.monotonic() < deadline, "requests still run after 30 s"
        time.sleep(0.02)  # waits on the child publishing its stats


async def _collect(engine: EngineProcess, prompt: list[int], rid: str) -> list[StreamDelta]:
    return [d async for d in engine.generate(prompt, GREEDY, rid)]


def test_streams_match_offline_and_cancel_frees_kv(engine: EngineProcess, oracle: Oracle) -> None:
    prompts = [tokens(50, seed=21), tokens(7, seed=22)]

    async def cancel_midway() -> None:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        gen = engine.generate(tokens(40, seed=23), long, "cancelled")
        async for d in gen:
            if d.completion_tokens >= 3:
                break
        await gen.aclose()

    async def main() -> list[list[StreamDelta]]:
        *streams, _ = await asyncio.gather(
            *(_collect(engine, p, f"p{i}") for i, p in enumerate(prompts)), cancel_midway()
        )
        return streams

    aborts_before = engine.stats().aborts
    for prompt, deltas in zip(prompts, asyncio.run(main())):
        assert [t for d in deltas for t in d.token_ids] == oracle.greedy(prompt, 10)
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].prompt_len == len(prompt)
    _wait_idle(engine)
    engine.check_integrity()
    s = engine.stats()
    assert s.aborts == aborts_before + 1 and s.full.used == 0 and s.swa.used == 0
    assert engine.flush_cache()
    events, snapshot = engine.drain_and_snapshot()
    assert events and snapshot == {}  # the flush removed every page it had published
    assert engine.stats().full.free == engine.stats().full.total


def test_cache_events_come_with_the_deltas(engine: EngineProcess) -> None:
    """A finished stream's cache events are in the replica once its final delta is: draining
    them needs no round trip, so it answers while the child is stopped (SIGSTOP) — fetching
    them from the child waited for the step in flight. Replaying every drain reproduces the
    child's own snapshot (events that came before `drain_and_snapshot`'s reply precede it)."""
    engine.flush_cache()
    _, pages = engine.drain_and_snapshot()
    prompts = [tokens(40, seed=21), tokens(56, seed=22)]
    for deltas in asyncio.run(_collect_all(engine, prompts)):
        assert deltas[-1].finished
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        result: list[object] = []
        drainer = threading.Thread(target=lambda: result.append(engine.drain_cache_events()))
        drainer.start()
        drainer.join(timeout=60)
        assert result, "drain_cache_events waited for the (stopped) child"
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    events = result[0]
    assert isinstance(events, list) and any(e.kind is EventKind.STORED for e in events)
    replay(events, pages)
    more, snapshot = engine.drain_and_snapshot()
    assert replay(more, pages) == snapshot and snapshot


async def _collect_all(engine: EngineProcess, prompts: list[list[int]]) -> list[list[StreamDelta]]:
    return list(
        await asyncio.gather(*(_collect(engine, p, f"ev{i}") for i, p in enumerate(prompts)))
    )


def test_the_child_runs_at_the_niceness_asked(engine: EngineProcess) -> None:
    assert engine.niceness == NICENESS
    threads = os.listdir(f"/proc/{engine.pid}/task")
    assert len(threads) >= 2  # the step (main) and control threads at least
    assert {os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads} == {NICENESS}


def test_the_child_froze_its_start_up_heap(engine: EngineProcess) -> None:
    """Torch's and the model's objects are out of the collector's reach once the engine is
    built: an oldest-generation collection on the step thread scans only what requests built
    (~110-120 ms a full collection on the serving ceiling's engine without it, ~4 ms with)."""
    assert engine.frozen_objects > 10_000


def test_a_niceness_it_may_not_take_is_logged_and_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    calls: list[int] = []

    def refuse(which: int, who: int, prio: int) -> None:
        calls.append(prio)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(engine_process.os, "setpriority", refuse)
    with caplog.at_level(logging.INFO, logger=engine_process.__name__):
        assert engine_process.set_niceness(before - 5) == before
    assert calls == [before - 5]  # tried once, nothing left half-applied
    assert f"runs at {before}" in caplog.text and "CAP_SYS_NICE" in caplog.text
    assert engine_process.set_niceness(before) == before and calls == [before - 5]  # no call


def test_a_refused_add_raises_its_value_error_before_any_delta(engine: EngineProcess) -> None:
    """The add is the check (no validation round trip before it): a request that can never run
    raises the engine's ValueError at the stream's first step, the child keeps serving, and the
    next good request streams as usual."""

    async def first(prompt: list[int], params: SamplingParams, rid: str) -> StreamDelta | None:
        gen = engine.generate(prompt, params, rid)
        try:
            return await anext(gen, None)
        finally:
            await gen.aclose()

    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(first([], GREEDY, "empty"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        asyncio.run(first([1, 2], SamplingParams(max_tokens=engine.max_model_len), "long"))
    assert engine.error is None and not engine._streams
    out = asyncio.run(_collect(engine, [1, 2, 3], "good"))
    assert sum(len(d.token_ids) for d in out) == GREEDY.max_tokens and out[-1].finished
    _wait_idle(engine)


def test_a_dead_child_fails_streams_and_calls(oracle: Oracle) -> None:
    cfg = EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048)
    ep = EngineProcess(cfg)
    try:
        long = SamplingParams(max_tokens=100_000 // 64, temperature=0.0, ignore_eos=True)

        async def main() -> None:
            async for _ in ep.generate(tokens(20, seed=24), long, "doomed"):
                os.kill(ep._proc.pid, signal.SIGKILL)

        with pytest.raises(EngineGoneError, match="engine process is gone"):
            asyncio.run(main())
        assert ep.error is not None
        with pytest.raises(RuntimeError, match="internal error"):
            ep.check_integrity()
    finally:
        ep.shutdown()


def test_a_step_that_raises_tells_the_replica_and_ends_every_stream(
    oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's step raises (a failure no one request owns): what finished before reaches
    the replica, then `_Died`; every open stream raises `EngineGoneError` naming the step's
    failure, and calls fail at once. (The child runs in this process over a pipe, so its step
    can be made to fail.)"""
    import multiprocessing
    import subprocess
    import sys

    cfg = EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048)
    child_end, replica_end = multiprocessing.Pipe()
    child = engine_process._Child(child_end, cfg)  # type: ignore[arg-type]
    step = child.engine.step

    def dying() -> list[StreamDelta]:
        req = child.engine.scheduler.reqs.get("a")
        if req is not None and len(req.output) >= 2:
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(child.engine, "step", dying)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])  # stands in for the child process
    exited.wait()
    ep = EngineProcess.__new__(EngineProcess)
    ep.config = cfg
    ep._attach(replica_end, exited, child.ready())  # type: ignore[arg-type]
    threading.Thread(target=child.control, daemon=True).start()
    died: list[BaseException] = []

    def step_loop() -> None:
        try:
            child.step_loop()
        except RuntimeError as exc:
            died.append(exc)
            child_end.close()  # the child process would exit here

    stepper = threading.Thread(target=step_loop, daemon=True)
    stepper.start()

    async def stream(rid: str, prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for d in ep.generate(prompt, GREEDY, rid):
            out += d.token_ids
        return out

    async def main() -> list[BaseException | list[int]]:
        return await asyncio.gather(stream("a", tokens(20, seed=31)), stream("b", tokens(9, seed=32)),
                                    return_exceptions=True)  # fmt: skip

    results = asyncio.run(main())
    assert [type(r) for r in results] == [EngineGoneError, EngineGoneError], results
    assert all("step failed (RuntimeError: device lost)" in str(r) for r in results)
    stepper.join(30)  # it raises right after sending `_Died`
    assert died and ep.error is not None
    with pytest.raises(RuntimeError, match="internal error"):
        ep.check_integrity()
    ep.shutdown()
    child.engine.close()


def test_the_child_ignores_modules_in_the_working_directory(
    oracle: Oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica's working directory holding a module named like one the engine imports (here
    `numpy.py`, which would raise) does not reach the child: it runs with `-P`."""
    (tmp_path / "numpy.py").write_text("raise ImportError('planted in the working directory')\n")
    monkeypatch.chdir(tmp_path)
    ep = EngineProcess(EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048))
    try:

        async def main() -> list[int]:
            return [t async for d in ep.generate(tokens(12, seed=5), GREEDY, "r") for t in d.token_ids]

        assert asyncio.run(main()) == oracle.greedy(tokens(12, seed=5), GREEDY.max_tokens)
    finally:
        ep.shutdown()

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, tokens
from worker.config import EngineConfig
from worker.errors import EngineGoneError
from worker.hosts.async_engine import AsyncEngine


def test_streams_match_offline_and_cancel_frees_kv(oracle: Oracle) -> None:
    cfg = EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048,
                       swa_full_tokens_ratio=0.25, chunked_prefill_size=32, swa_eviction_interval=8)  # fmt: skip
    engine = AsyncEngine(cfg)
    try:
        prompt = tokens(50, seed=11)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

        async def collect(rid: str) -> list[int]:
            out = []
            async for d in engine.generate(prompt, params, rid):
                out += d.token_ids
            return out

        async def cancel_midway() -> None:
            gen = engine.generate(tokens(40, seed=12), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), "b")
            async for d in gen:
                if d.completion_tokens >= 3:
                    break
            await gen.aclose()

        async def main() -> list[int]:
            got, _ = await asyncio.gather(collect("a"), cancel_midway())
            return got

        got = asyncio.run(main())
        assert got == oracle.greedy(prompt, 10)
        # The abort is processed on the step thread; wait until the engine is idle.
        deadline = time.monotonic() + 30
        while (s := engine.stats()).running or s.waiting:
            assert time.monotonic() < deadline, "the aborted request still runs after 30 s"
            time.sleep(0.02)  # waits on the step thread processing the abort
        engine.check_integrity()
        s = engine.stats()
        assert s.aborts == 1 and s.full.used == 0 and s.swa.used == 0
        assert engine.flush_cache()
        s = engine.stats()
        assert s.full.free == s.full.total
    finally:
        engine.shutdown()


def test_a_step_that_raises_ends_every_stream_and_call_at_once(
    oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step thread dies: a running stream and one still in the inbox (which no step will
    ever answer) both raise `EngineGoneError`; calls and new requests fail at once."""
    cfg = EngineConfig(model=str(oracle.path), page_size=4, max_total_tokens=2048)
    engine = AsyncEngine(cfg)
    blocked, go = threading.Event(), threading.Event()
    step = engine.engine.step

    def dying() -> list[StreamDelta]:
        req = engine.engine.scheduler.reqs.get("a")
        if req is not None and len(req.output) >= 2:
            blocked.set()
            go.wait()
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(engine.engine, "step", dying)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def collect(rid: str, prompt: list[int]) -> list[int]:
        return [t async for d in engine.generate(prompt, params, rid) for t in d.token_ids]

    async def main() -> list[BaseException | list[int]]:
        a = asyncio.create_task(collect("a", tokens(20, seed=21)))
        await asyncio.to_thread(blocked.wait)
        b = asyncio.create_task(collect("b", tokens(9, seed=22)))
        while "b" not in engine._streams:  # added to the inbox (no await between the two)
            await asyncio.sleep(0)  # a turn of the loop until the add lands, no clock
        go.set()
        return await asyncio.gather(a, b, return_exceptions=True)

    try:
        results = asyncio.run(main())
        assert [type(r) for r in results] == [EngineGoneError, EngineGoneError], results
        assert engine.error is not None
        with pytest.raises(RuntimeError, match="internal error"):
            engine.check_integrity()
        with pytest.raises(RuntimeError, match="internal error"):
            asyncio.run(collect("c", tokens(5, seed=23)))
    finally:
        engine.shutdown()

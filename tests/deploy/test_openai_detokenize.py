"""Incremental detokenization and stop strings (ingress side), and the worker deployment class."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.detokenize import IncrementalDetokenizer, StopTextStream
from deploy.worker_deployment import WorkerDeployment, WorkerOptions
from deploy.worker_protocol import StreamStart
from router.request import RoutedRequest
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.tokenizer import make_tokenizer_dir
from worker.config import EngineConfig
from worker.sampling_params import SamplingParams

TEXT = "Héllo wörld — 😀 sliding windows ✓ done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_decode_matches_full_decode(tokenizer: Any, step: int) -> None:
    """Feeding tokens k at a time yields exactly the full decode, never a split character."""
    ids = tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_token_boundaries_is_never_leaked(tokenizer: Any) -> None:
    """A stop string spanning tokens is cut; no emitted piece contains any part of it."""
    ids = tokenizer(TEXT)["input_ids"]
    stream = StopTextStream(tokenizer, ["sliding win"])
    pieces = []
    for i, t in enumerate(ids):
        piece = stream.feed([t], final=i == len(ids) - 1)
        pieces.append(piece.text)
        if piece.stopped:
            break
    assert stream.stopped and "".join(pieces) == TEXT[: TEXT.index("sliding win")]


def test_held_back_tail_is_released_at_the_end(tokenizer: Any) -> None:
    """Text that merely looks like a stop-string prefix comes out when the request finishes."""
    ids = tokenizer("abc sli")["input_ids"]
    stream = StopTextStream(tokenizer, ["sliding"])
    out = "".join(stream.feed([t], final=i == len(ids) - 1).text for i, t in enumerate(ids))
    assert out == "abc sli" and not stream.stopped


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
    """Invalid requests and requests during drain get a refusing StreamStart and nothing else."""
    w, _ = _worker()
    too_long = asyncio.run(_collect(w, RoutedRequest([1] * 60, "a", params=SamplingParams(max_tokens=10))))
    assert too_long == [StreamStart("r1", "invalid", too_long[0].message)] and "max_model_len" in too_long[0].message
    w.shutdown()
    drained = asyncio.run(_collect(w, RoutedRequest([1, 2], "b", params=SamplingParams(max_tokens=2))))
    assert drained[0].refusal == "unavailable" and len(drained) == 1


def test_worker_stream_and_routing_stats() -> None:
    """A stream is StreamStart then deltas summing to max_tokens; routing stats follow cluster.load."""
    from cluster.load import WorkerLoad

    w, engine = _worker()
    items = asyncio.run(_collect(w, RoutedRequest([1, 2, 3], "a", params=SamplingParams(max_tokens=7, temperature=0))))
    assert items[0] == StreamStart("r1")
    assert sum(len(d.token_ids) for d in items[1:]) == 7 and items[-1].finished
    stats = w.record_routing_stats()
    load = WorkerLoad.from_routing_stats(stats)
    assert load is not None and load.worker_id == "r1" and load.full.total == engine.stats().full.total
    assert stats["full_peak_used_tokens"] > 0 and stats["swa_total_tokens"] > 0


def test_health_check_flags_a_stalled_engine() -> None:
    """check_health raises when work is pending but the engine step counter stops moving."""
    w, engine = _worker(options=WorkerOptions(stall_timeout_s=0.05))
    w.check_health()  # idle: healthy
    engine._held["stuck"] = 3  # a running request that never advances
    w.check_health()
    import time

    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="no step"):
        w.check_health()

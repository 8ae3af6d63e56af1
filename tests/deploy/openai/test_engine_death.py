"""An engine that dies under a request, through the whole ingress (in-process, no Ray): the
client gets a 503 with Retry-After (never a 500 or a hang), and a request that kills every
engine it reaches — a poison request — is sent to a second replica at most, then answered, so it
takes down two replicas, not every one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.sampling_params import SamplingParams
from deploy.openai.streaming import ENGINE_DIED
from tests.deploy.openai.openai_harness import (
    MODEL,
    Harness,
    expected_greedy,
    make_harness,
    sse_events,
)
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.tokenizer import make_tokenizer_dir
from worker.errors import EngineGoneError

POISON = [66, 66, 66]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _killed_by(engine: FakeEngine, poison: list[int], after: int) -> None:
    """`engine` dies (its process gone: `EngineGoneError`, `error` set) once a request with the
    prompt `poison` has streamed `after` deltas."""
    real = engine.generate

    async def generate(token_ids: list[int], params: SamplingParams, *args: Any, **kw: Any) -> Any:
        sent = 0
        async for delta in real(token_ids, params, *args, **kw):
            if token_ids == poison and sent == after:
                engine.error = RuntimeError("the engine process is gone (exit code -9)")
                raise EngineGoneError("engine stopped: the engine process is gone (exit code -9)")
            sent += 1
            yield delta

    engine.generate = generate  # type: ignore[method-assign]


def _harness(tokenizer: Any, workers: int, after: int = 1) -> Harness:
    h = make_harness(tokenizer, workers=workers, step_s=0.002)
    for engine in h.engines:
        _killed_by(engine, POISON, after)
    return h


def _post(h: Harness, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json=body)

    return asyncio.run(go())


def _body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}


@pytest.mark.parametrize("after", [0, 2], ids=["before_the_first_token", "mid_generation"])
def test_a_poison_request_kills_two_replicas_not_all(tokenizer: Any, after: int) -> None:
    """It is restarted once on another replica, which dies too; then it is answered 503 with
    Retry-After, and the third replica, which it never reached, serves the next request."""
    h = _harness(tokenizer, workers=3, after=after)
    r = _post(h, _body(POISON))
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["message"].startswith(ENGINE_DIED)  # then the request id (5xx)
    assert [e.error is not None for e in h.engines] == [True, True, False]
    assert [len(e.seen) for e in h.engines] == [1, 1, 0]
    ok = _post(h, _body([11, 22, 33]))  # round robin: the third replica
    assert ok.status_code == 200 and ok.headers["x-swaserve-replica"] == "w2", ok.text
    want = tokenizer.decode(expected_greedy([11, 22, 33], 8, len(tokenizer)), skip_special_tokens=True)
    assert ok.json()["choices"][0]["text"] == want


def test_one_death_costs_a_restart_not_the_request(tokenizer: Any) -> None:
    """An engine that dies under a request it did not kill (the next replica serves it): 200."""
    h = make_harness(tokenizer, workers=2, step_s=0.002)
    _killed_by(h.engines[0], [5, 6, 7], after=1)
    r = _post(h, _body([5, 6, 7]))
    assert r.status_code == 200 and r.headers["x-swaserve-replica"] == "w1", r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_a_stream_whose_engine_dies_ends_with_a_503_event(tokenizer: Any) -> None:
    """The client already has tokens: an in-band error event with the 503's code, then the end."""
    h = _harness(tokenizer, workers=2, after=2)
    r = _post(h, _body(POISON, stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "service_unavailable", events[-1]
    assert events[-1]["error"]["message"].startswith(ENGINE_DIED)
    assert [len(e.seen) for e in h.engines] == [1, 0]  # not sent again: it had tokens


def test_a_replica_whose_engine_is_dead_answers_503_not_500(tokenizer: Any) -> None:
    """Requests reaching a replica after its engine died (before Serve replaces it): 503 with
    Retry-After, whatever its engine's calls raise."""
    h = make_harness(tokenizer, workers=1)
    engine = h.engines[0]
    engine.error = RuntimeError("the engine process is gone")
    r = _post(h, _body([1, 2, 3]))
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text

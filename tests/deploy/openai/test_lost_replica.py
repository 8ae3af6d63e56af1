"""A worker replica (or its engine process) lost mid-generation (in-process, no Ray): a
non-streaming request is restarted on another replica and answered in full; a stream, whose client already has tokens,
ends with an in-band error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from cluster.messages import EngineDiedError, RoutedRequest, StreamStart, WorkerUnavailableError
from core.outputs import StreamDelta
from deploy.openai.service import PLAIN_RESTARTS
from deploy.openai.streaming import ENGINE_DIED
from deploy.replica.client import DeathRecord
from tests.deploy.openai.openai_harness import MODEL, expected_greedy, make_harness, sse_events
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


class DyingClient:
    """Wraps the in-process client: the first `deaths` streams lose their replica after the
    first delta (what a node that went away looks like to the ingress)."""

    def __init__(self, inner: Any, deaths: int, death: type[Exception] = ActorUnavailableError) -> None:
        self._inner, self._deaths, self._death = inner, deaths, death
        self.sent: list[RoutedRequest] = []

    async def stream(
        self, request: RoutedRequest, deaths: DeathRecord | None = None
    ) -> AsyncIterator[StreamStart | StreamDelta]:
        self.sent.append(request)
        dies = len(self.sent) <= self._deaths
        deltas = 0
        async for item in self._inner.stream(request, deaths):
            yield item
            if isinstance(item, StreamDelta):
                deltas += 1
                if dies and deltas == 1 and not item.finished:
                    if self._death is ActorUnavailableError:
                        raise ActorUnavailableError("the node went away", None)
                    raise self._death("worker w0: its engine died while running the request")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _post(h: Any, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json=body)

    return asyncio.run(go())


def _harness(
    tokenizer: Any, deaths: int, death: type[Exception] = ActorUnavailableError
) -> tuple[Any, DyingClient]:
    # A slow fake step, so the answer takes several deltas (the replica dies after the first).
    h = make_harness(tokenizer, workers=2, step_s=0.002)
    client = DyingClient(h.service._client, deaths, death)
    h.service._client = client  # type: ignore[assignment]
    return h, client


@pytest.mark.parametrize("death", [ActorUnavailableError, WorkerUnavailableError])
def test_a_plain_request_survives_its_replica_dying_mid_generation(
    tokenizer: Any, death: type[Exception]
) -> None:
    """The replica process lost (ActorUnavailableError), or only its engine process
    (the worker deployment raises WorkerUnavailableError): restarted on the other replica."""
    h, client = _harness(tokenizer, deaths=1, death=death)
    prompt = [11, 22, 33]
    r = _post(h, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    want = expected_greedy(prompt, 8, len(tokenizer))
    assert r.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert r.json()["usage"]["completion_tokens"] == 8  # counted once, from the run that answered
    assert len(client.sent) == 2
    first = r.headers["x-swaserve-replica"]
    assert client.sent[0].avoid == () and client.sent[1].avoid == ("w0",)
    assert first == "w1"  # the header names the replica that answered


def test_out_of_restarts_the_plain_request_gets_503(tokenizer: Any) -> None:
    """Replicas lost without their engine dying under the request (shutting down): restarted
    up to `PLAIN_RESTARTS` times, then 503."""
    h, client = _harness(tokenizer, deaths=PLAIN_RESTARTS + 1, death=WorkerUnavailableError)
    r = _post(h, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    assert len(client.sent) == PLAIN_RESTARTS + 1
    assert set(client.sent[-1].avoid) == {"w0", "w1"}


@pytest.mark.parametrize("death", [ActorUnavailableError, EngineDiedError])
def test_a_request_that_two_replicas_died_running_gets_503_not_a_third(
    tokenizer: Any, death: type[Exception]
) -> None:
    """A replica (or its engine) dying under the request may be the request's doing: after the
    second such replica it is answered (503, Retry-After), never sent to a third."""
    h, client = _harness(tokenizer, deaths=PLAIN_RESTARTS + 1, death=death)
    r = _post(h, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["message"].startswith(ENGINE_DIED)  # then the request id (5xx)
    assert len(client.sent) == 2


def test_a_stream_that_loses_its_replica_ends_with_an_error_event(tokenizer: Any) -> None:
    h, client = _harness(tokenizer, deaths=1)
    r = _post(h, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "service_unavailable", events[-1]
    assert len(client.sent) == 1  # not restarted: the client already has tokens

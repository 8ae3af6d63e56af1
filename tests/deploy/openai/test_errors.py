"""Error bodies say nothing internal: exception text, paths and tracebacks go to the log with
the request id the client also gets; the engine's endings written for clients pass through
(in-process ingress, fake engines)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.openai.errors import generation_failed
from tests.deploy.openai.openai_harness import MODEL, make_harness, sse_events
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.tokenizer import make_tokenizer_dir

SECRET = "/srv/models/secret-dir/model.safetensors"
TRACEBACK = f'Traceback (most recent call last):\n  File "{SECRET}", line 1\nRuntimeError: boom'
CLIENT_ERROR = "structured output: the grammar allows no token here that the request's logit_bias leaves open"
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


class EndsWithError(FakeEngine):
    """Every request ends at once with `ending` (what an engine's per-request failure sends)."""

    ending = TRACEBACK  # NOTE: not `error`: that is the engine's own fatal error (None: healthy)

    async def generate(self, token_ids: list[int], params: SamplingParams, request_id: str,
                       follows: str | None = None) -> AsyncGenerator[StreamDelta, None]:  # fmt: skip
        yield StreamDelta(request_id, [], True, "abort", len(token_ids), 0, 0, error=self.ending)


class ClientFacing(EndsWithError):
    ending = CLIENT_ERROR


class Raises(FakeEngine):
    """The engine call raises, as a Ray task error would (its text: a remote traceback)."""

    async def generate(self, token_ids: list[int], params: SamplingParams, request_id: str,
                       follows: str | None = None) -> AsyncGenerator[StreamDelta, None]:  # fmt: skip
        raise RuntimeError(TRACEBACK)
        yield  # pragma: no cover - an async generator


def _post(h: Any, body: dict[str, Any], rid: str) -> Any:
    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json=body, headers={"x-request-id": rid})

    return asyncio.run(go())


@pytest.mark.parametrize("engine", [EndsWithError, Raises], ids=["delta-error", "raises"])
def test_internal_errors_answer_500_with_the_request_id_and_log_the_details(
    tokenizer: Any, engine: type[FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """A worker error the client should not read is a 500 naming the request id, no text from
    inside; the log has the details under that id. Streamed: the same in an SSE error event."""
    h = make_harness(tokenizer, engine=engine)
    with caplog.at_level(logging.ERROR, logger="swaserve.ingress"):
        plain = _post(h, BODY, "rid-plain")
        stream = _post(h, {**BODY, "stream": True}, "rid-stream")
    assert plain.status_code == 500 and plain.headers["x-request-id"] == "rid-plain"
    error = plain.json()["error"]
    assert error["message"] == "internal error while generating (request id rid-plain)"
    assert error["type"] == "server_error"
    (event,) = [e for e in sse_events(stream.text) if isinstance(e, dict) and "error" in e]
    assert event["error"]["message"] == "internal error while generating (request id rid-stream)"
    for text in (plain.text, stream.text):
        assert "secret" not in text and "Traceback" not in text and "RuntimeError" not in text
    logged = [r for r in caplog.records if "rid-plain" in r.getMessage()]
    assert logged and SECRET in logged[0].getMessage() + str(logged[0].exc_text)
    assert any("rid-stream" in r.getMessage() for r in caplog.records)
    assert h.service.inflight == 0


def test_an_error_written_for_the_client_passes_as_a_400(tokenizer: Any) -> None:
    """The engine's per-request endings (`CLIENT_ERROR_KINDS`) reach the client as they are,
    a 400: the request's own constraints left no way on."""
    h = make_harness(tokenizer, engine=ClientFacing)
    plain, stream = _post(h, BODY, "r1"), _post(h, {**BODY, "stream": True}, "r2")
    assert plain.status_code == 400 and plain.json()["error"]["message"] == CLIENT_ERROR
    (event,) = [e for e in sse_events(stream.text) if isinstance(e, dict) and "error" in e]
    assert event["error"]["message"] == CLIENT_ERROR


def test_only_the_declared_kinds_pass() -> None:
    """A kind must lead the text ("<kind>: "); a look-alike further in does not pass."""
    assert generation_failed("sampling: the model gave no finite logit").status == 400
    assert generation_failed("engine died; sampling: x").status == 500
    assert generation_failed("structured output").status == 500


def test_an_unexpected_exception_is_a_bare_500_with_the_request_id(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The catch-all: an exception no handler maps answers 500 "internal error" with the
    request id (header and message); the exception and its text go to the log only."""
    h = make_harness(tokenizer)

    async def broken() -> Any:
        raise OSError(f"cannot read {SECRET}")

    h.service.models = broken  # type: ignore[method-assign]

    async def go() -> Any:
        # Starlette re-raises after answering (for the server's log): the transport keeps it.
        transport = httpx.ASGITransport(app=h.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as c:
            return await c.get("/v1/models", headers={"x-request-id": "rid-x"})

    with caplog.at_level(logging.ERROR, logger="swaserve.ingress"):
        r = asyncio.run(go())
    assert r.status_code == 500 and r.headers["x-request-id"] == "rid-x"
    assert r.json()["error"] == {"message": "internal error (request id rid-x)", "type": "server_error",
                                 "param": None, "code": None}  # fmt: skip
    assert any("rid-x" in rec.getMessage() and SECRET in str(rec.exc_text) for rec in caplog.records)

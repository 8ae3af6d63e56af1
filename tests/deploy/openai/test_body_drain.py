"""An oversized body is read to its end before the 413 goes out (so the client, still sending,
is not reset), within a bound; over raw ASGI, with no Ray and no sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.openai import ingress
from tests.deploy.openai.openai_harness import make_harness
from tests.fakes.tokenizer import make_tokenizer_dir

CHUNK = 1024


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _call(app: Any, chunks: int, content_length: bool) -> tuple[int, int, int]:
    """POST `chunks` KiB; → (status, chunks read before the response started, chunks read)."""
    read, read_at_start, status = 0, -1, 0
    headers = [(b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(chunks * CHUNK).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("ingress", 80), "client": ("127.0.0.1", 1)}  # fmt: skip

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read >= chunks:
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": b" " * CHUNK, "more_body": read < chunks}

    async def send(message: dict[str, Any]) -> None:
        nonlocal read_at_start, status
        if message["type"] == "http.response.start":
            read_at_start, status = read, message["status"]

    asyncio.run(app(scope, receive, send))
    return status, read_at_start, read


@pytest.mark.parametrize("content_length", [True, False], ids=["by-header", "by-bytes"])
def test_oversized_body_is_read_before_the_413(tokenizer: Any, content_length: bool) -> None:
    """Whether Content-Length or the bytes tell, the whole body is consumed first."""
    h = make_harness(tokenizer, max_request_bytes=4 * CHUNK)
    assert _call(h.app, 64, content_length) == (413, 64, 64)


def test_draining_stops_at_its_bound(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_DRAIN_BYTES the 413 goes out without reading more."""
    monkeypatch.setattr(ingress, "MAX_DRAIN_BYTES", 8 * CHUNK)
    h = make_harness(tokenizer, max_request_bytes=4 * CHUNK)
    status, at_start, _ = _call(h.app, 1000, content_length=True)
    assert status == 413 and at_start == 9  # the bound (8 KiB) plus the chunk that crossed it

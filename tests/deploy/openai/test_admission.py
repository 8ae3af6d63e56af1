"""Admission by work (sequences and tokens in flight, 429 / 400), the request deadline (504) and
the slow-reader write timeout, each freeing the request's KV on its worker (in-process ingress,
fake engines; time is driven by engines that never finish and clients that never read)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import pytest

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.openai.admission import AdmissionLimits
from tests.deploy.openai.openai_harness import MAX_MODEL_LEN, MODEL, make_harness, sse_events
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.tokenizer import make_tokenizer_dir

PROMPT = [40, 41, 42]  # plain text tokens (0-7 are the tokenizer's special tokens)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


class OneTokenThenStall(FakeEngine):
    """Holds the prompt's KV, sends one token, then waits until it is aborted (a generation
    that would outlast any test)."""

    async def generate(self, token_ids: list[int], params: SamplingParams, request_id: str,
                       follows: str | None = None) -> AsyncGenerator[StreamDelta, None]:  # fmt: skip
        self._admit(request_id, token_ids, params.root_hash)
        try:
            self._grow(request_id)
            yield StreamDelta(request_id, [token_ids[-1]], False, None, len(token_ids), 0, 1)
            await asyncio.Event().wait()  # aborted by the caller's cancellation
        finally:
            self._release(request_id, aborted=True)


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **fields}


async def _held(h: Any, body: dict[str, Any]) -> Any:
    """A streamed request admitted and started, its events not read yet (it holds its share)."""
    return await h.service.completions(json.dumps({**body, "stream": True}).encode())


def test_sequences_are_prompts_times_choices_best_of_included(tokenizer: Any) -> None:
    """n, best_of and prompt batches count as sequences: over what is left -> 429 with
    Retry-After; then admitted again once the first request's events are read to the end."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=6, tokens=10_000))

    async def go() -> tuple[Any, ...]:
        held = await _held(h, _completion(prompt=[PROMPT, PROMPT], n=2))  # 4 sequences
        seen = h.service.admission.sequences, h.service.admission.tokens
        async with h.client() as c:
            busy = await c.post("/v1/completions", json=_completion(best_of=3))  # 3 more: 7 > 6
            fits = await c.post("/v1/completions", json=_completion(n=2))  # 6
            _ = [e async for e in held.events]
            after = await c.post("/v1/completions", json=_completion(best_of=3, logprobs=1))
        return seen, busy, fits, after

    seen, busy, fits, after = asyncio.run(go())
    assert seen == (4, 2 * len(PROMPT) + 4 * 8)  # each prompt once, max_tokens per choice
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded" and "sequences" in busy.json()["error"]["message"]
    assert fits.status_code == after.status_code == 200
    assert (h.service.admission.sequences, h.service.admission.tokens, h.service.inflight) == (0, 0, 0)


def test_tokens_count_prompt_and_max_tokens_per_choice(tokenizer: Any) -> None:
    """A chat without max_tokens may hold the whole context; another request over what is left
    of the token bound is refused with 429 while it runs."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=64, tokens=MAX_MODEL_LEN + 20))

    async def go() -> tuple[Any, ...]:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        held = await h.service.chat(json.dumps(chat).encode())
        tokens = h.service.admission.tokens
        async with h.client() as c:
            busy = await c.post("/v1/completions", json=_completion(max_tokens=20))
            small = await c.post("/v1/completions", json=_completion(max_tokens=2))
        await held.events.aclose()  # type: ignore[union-attr]
        return tokens, busy, small

    tokens, busy, small = asyncio.run(go())
    assert tokens == MAX_MODEL_LEN  # the prompt plus the rest of the context
    assert busy.status_code == 429 and "tokens" in busy.json()["error"]["message"]
    assert small.status_code == 200 and h.service.admission.tokens == 0


@pytest.mark.parametrize(("body", "param"), [
    (_completion(best_of=5), "best_of"),
    (_completion(prompt=[PROMPT] * 3, n=2), "n"),
    (_completion(max_tokens=60, n=2), "max_tokens"),
])  # fmt: skip
def test_a_request_larger_than_a_bound_alone_is_a_400(tokenizer: Any, body: dict[str, Any], param: str) -> None:
    """A request that could never be admitted is a 400 naming the field to lower, not a 429."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=4, tokens=100))

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert h.service.inflight == 0 and not h.engines[0].seen


def test_no_sequence_left_refuses_before_tokenizing(tokenizer: Any) -> None:
    """With every sequence taken, a request is refused 429 before its prompt is tokenized."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=1))

    async def go() -> Any:
        held = await _held(h, _completion())
        calls: list[Any] = []
        h.service.pool.run = lambda *a: calls.append(a)  # type: ignore[method-assign]
        async with h.client() as c:
            busy = await c.post("/v1/completions", json=_completion(prompt="x" * 1000))
        await held.events.aclose()
        return busy, calls

    busy, calls = asyncio.run(go())
    assert busy.status_code == 429 and calls == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_deadline_aborts_the_request_and_frees_its_kv(tokenizer: Any, stream: bool) -> None:
    """Past request_timeout_s a request that is still generating is aborted on its worker (KV
    back to idle) and answered 504 (a stream: an error event, then the end)."""
    h = make_harness(tokenizer, engine=OneTokenThenStall, request_timeout_s=0.05)

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json=_completion(max_tokens=40, stream=stream))

    r = asyncio.run(go())
    if stream:
        events = sse_events(r.text)
        assert r.status_code == 200 and events[0]["choices"][0]["text"]  # the token it had
        error = events[-1]["error"]
    else:
        assert r.status_code == 504
        error = r.json()["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    engine = h.engines[0]
    assert engine.stats().full.used == 0 and engine.stats().aborts == 1
    engine.check_integrity()
    assert h.service.inflight == 0


def _asgi_post(body: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]]]:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("ingress", 80)}  # fmt: skip
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up
        raise AssertionError("unreachable")

    return scope, receive


@pytest.mark.parametrize("where", ["app", "server"])
def test_a_client_that_stops_reading_is_cut_off_and_its_kv_freed(
    tokenizer: Any, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A stream whose client reads nothing (every body write waits for ever) ends after
    write_timeout_s: the request is aborted on its worker, which is back to idle, and its
    admission share is returned. `server`: the bound is the server-level `WriteTimeout` (the
    app's own is 30 s), whose published `send` takes the middle chunks past the app's layers."""
    from deploy.openai.write_timeout import WriteTimeout

    if where == "app":
        h = make_harness(tokenizer, engine=OneTokenThenStall, write_timeout_s=0.05)
        app = h.app
    else:
        h = make_harness(tokenizer, engine=OneTokenThenStall)
        app = WriteTimeout(h.app, 0.05, publish=True)
    scope, receive = _asgi_post(_completion(max_tokens=40, stream=True))
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
            return
        await asyncio.Event().wait()  # the client's window is full: the write never completes

    async def go() -> tuple[int, int]:
        task = asyncio.create_task(app(scope, receive, send))
        deadline = asyncio.get_running_loop().time() + 60
        while not h.engines or not h.engines[0].stats().full.used:
            assert not task.done(), "the request ended before reaching the worker"
            assert asyncio.get_running_loop().time() < deadline, "the request never reached the worker"
            await asyncio.sleep(0)  # waits on the request reaching the worker
        held = h.engines[0].stats().full.used
        await asyncio.wait_for(task, 30)  # the write timeout ends it
        deadline = asyncio.get_running_loop().time() + 30
        while h.engines[0].stats().full.used and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0)  # waits on the stream's close (a task of its own)
        return held, h.engines[0].stats().full.used

    with caplog.at_level(logging.WARNING, logger="swaserve.ingress"):
        held, after = asyncio.run(go())
    assert statuses == [200] and held > 0 and after == 0
    assert h.engines[0].stats().aborts == 1 and h.service.inflight == 0
    assert any("read nothing" in r.getMessage() for r in caplog.records)


class _Spy:
    """An ASGI layer that records the messages its `send` sees."""

    def __init__(self, app: Any) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def spied(message: dict[str, Any]) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, spied)


def test_the_servers_write_timeout_takes_the_middle_chunks_past_the_apps_layers(tokenizer: Any) -> None:
    """Under the replica's own HTTP server (`WriteTimeout(..., publish=True)` around the app, as
    `direct_ingress_server` puts it): an SSE response's middle chunks reach the server's send
    past every layer in between, which see only the response's start and its last message;
    the server writes the same events as without the shortcut."""
    from deploy.openai.write_timeout import WriteTimeout

    h = make_harness(tokenizer)
    body = _completion(max_tokens=6, stream=True, ignore_eos=True)

    def serve(publish: bool) -> tuple[list[str], list[str], bytes]:
        spy = _Spy(h.app)
        app = WriteTimeout(spy, 30.0, publish=publish)
        scope, receive = _asgi_post(body)
        kinds: list[str] = []
        out = bytearray()

        async def send(message: dict[str, Any]) -> None:
            kinds.append(message["type"])
            out.extend(message.get("body", b""))

        asyncio.run(app(scope, receive, send))
        return kinds, spy.seen, bytes(out)

    kinds, seen, raw = serve(publish=True)
    plain_kinds, plain_seen, plain_raw = serve(publish=False)
    texts, plain_texts = ([[c["text"] for c in e["choices"]] for e in sse_events(r.decode()) if isinstance(e, dict)]
                          for r in (raw, plain_raw))  # fmt: skip
    assert kinds == plain_kinds and texts == plain_texts and len(texts) == 6
    assert plain_seen == plain_kinds  # every message through every layer
    assert seen == ["http.response.start", "http.response.body"]  # the first and the last only
    assert raw.endswith(b"data: [DONE]\n\n")


def test_the_published_send_leaves_no_reference_cycle() -> None:
    """The server's request cycle holds the scope and its `send` is a bound method of that
    cycle (uvicorn's `RequestResponseCycle`), so the bounded `send` left in the scope closes a
    reference cycle: it is taken out when the response ends, and the request's objects go with
    their last reference instead of at the collector's next pass."""
    import gc
    import weakref

    from deploy.openai.write_timeout import BODY_SEND, WriteTimeout

    class Cycle:  # the server's side of one request
        def __init__(self, scope: dict[str, Any]) -> None:
            self.scope = scope

        async def send(self, message: dict[str, Any]) -> None:
            pass

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await scope[BODY_SEND]({"type": "http.response.body", "body": b"x", "more_body": True})

    gc.collect()
    gc.disable()
    try:
        scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/completions"}
        cycle = Cycle(scope)
        gone = weakref.ref(cycle)
        asyncio.run(WriteTimeout(app, 30.0, publish=True)(scope, None, cycle.send))
        del cycle, scope
        assert gone() is None, "the request's cycle waits for the collector"
    finally:
        gc.enable()


def test_done_event_ends_the_response_before_the_cleanup() -> None:
    """An SSE stream's `[DONE]` goes out as the response's last message (no empty one after it),
    and the event generator's cleanup runs after that, in the closing task: a client whose
    stream ended gets the end before the server's bookkeeping for it."""
    from deploy.openai import ingress
    from deploy.openai.streaming import SSE_DONE

    log: list[object] = []

    async def events() -> Any:
        try:
            yield "data: 1\n\n"
            yield SSE_DONE
            log.append("after [DONE]")  # never: the response ended at the [DONE]
        finally:
            log.append("cleanup")

    async def send(message: dict[str, Any]) -> None:
        log.append((message["type"], message.get("body"), message.get("more_body")))

    async def run() -> None:
        response = ingress._ClosingStream(events(), media_type="text/event-stream")
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
        await asyncio.gather(*ingress._CLOSING)

    asyncio.run(run())
    assert log == [
        ("http.response.start", None, None),
        ("http.response.body", b"data: 1\n\n", True),
        ("http.response.body", SSE_DONE.encode(), False),
        "cleanup",
    ]


def test_a_streams_share_is_back_when_its_response_ends(tokenizer: Any) -> None:
    """A finished stream's admission share is back before its response's last message goes
    out (the rest of its cleanup runs after it): a client that sends its next request when a
    response ends finds the room the last one left."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=1, tokens=10_000))
    scope, receive = _asgi_post(_completion(max_tokens=3, stream=True, ignore_eos=True))
    at_end: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            at_end.append(h.service.admission.sequences)

    async def run() -> None:
        await h.app(scope, receive, send)
        from deploy.openai import ingress

        await asyncio.gather(*ingress._CLOSING)

    asyncio.run(run())
    assert at_end == [0]
    assert (h.service.admission.sequences, h.service.inflight) == (0, 0)

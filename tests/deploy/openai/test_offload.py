"""The event loop does no per-request CPU work: while a prompt is tokenized (or a chat
templated, or /tokenize runs), /health and other requests are answered (in-process ingress,
fake engines; the tokenizer is held at a gate, so nothing depends on timing)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from deploy.openai.offload import SMALL_BODY
from tests.deploy.openai.openai_harness import MODEL, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir

# Over `SMALL_BODY` (a body at most that size is prepared on the loop: cheaper than the hop).
LONG = "The quick brown fox jumps over the lazy dog. " * (SMALL_BODY // 45 + 1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


class GatedTokenizer:
    """The real tokenizer, except that tokenizing a long text waits at a gate the test opens,
    and says when it started and when it finished."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.started, self.gate, self.finished = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if len(text) >= len(LONG):
            self.started.set()
            self.gate.wait(60)
            out = self._tok(text, **kwargs)
            self.finished.set()
            return out
        return self._tok(text, **kwargs)

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


REQUESTS = {
    "completion": ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}),
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": LONG}),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_health_and_other_requests_answer_while_a_prompt_is_tokenized(tokenizer: Any, kind: str) -> None:
    """/health and a short completion are answered while a long prompt's tokenizing (a chat's
    template too) is held at the gate; the long request is answered once the gate opens."""
    gated = GatedTokenizer(tokenizer)
    h = make_harness(gated, max_model_len=4096)
    path, body = REQUESTS[kind]

    async def go() -> tuple[Any, ...]:
        async with h.client() as c:
            long = asyncio.create_task(c.post(path, json=body))
            assert await asyncio.to_thread(gated.started.wait, 60), "the long request never tokenized"
            health = await asyncio.wait_for(c.get("/health"), 30)
            short = await asyncio.wait_for(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}), 30)
            during = not gated.finished.is_set()
            gated.gate.set()
            return health, short, during, await long

    health, short, during, long = asyncio.run(go())
    assert during, "the other requests waited for the tokenizer: it ran on the event loop"
    assert health.status_code == short.status_code == long.status_code == 200, long.text


def test_large_deltas_and_final_bodies_render_on_the_pool(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta carrying an echoed prompt's logprobs, and a final body, are rendered on the
    pool's threads; a streamed delta of one token on the loop."""
    from deploy.openai import responses, service

    h = make_harness(tokenizer, max_model_len=4096)
    threads: dict[str, set[int]] = {"fold": set(), "event": set(), "_final_body": set()}

    def spy(owner: Any, name: str) -> Any:
        original = getattr(owner, name)

        def call(*args: Any) -> Any:
            threads[name].add(threading.get_ident())
            return original(*args)

        return call

    monkeypatch.setattr(responses.ResponseBuilder, "fold", spy(responses.ResponseBuilder, "fold"))
    monkeypatch.setattr(responses.ResponseBuilder, "event", spy(responses.ResponseBuilder, "event"))
    monkeypatch.setattr(service.OpenAIService, "_final_body", staticmethod(spy(service.OpenAIService, "_final_body")))
    echo = {"model": MODEL, "prompt": LONG, "max_tokens": 1, "echo": True, "logprobs": 1}
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}

    async def go() -> None:
        async with h.client() as c:
            assert (await c.post("/v1/completions", json=echo)).status_code == 200
            assert (await c.post("/v1/completions", json=small)).status_code == 200

    asyncio.run(go())  # on this thread: the event loop's
    loop = threading.get_ident()
    assert threads["_final_body"] and loop not in threads["_final_body"]
    assert threads["fold"] and loop not in threads["fold"]  # its delta has the prompt's logprobs
    assert threads["event"] == {loop}

"""Request limits at the in-process ingress (`deploy/openai/limits.py`): past one, a 400 naming
the field before the prompt is tokenized or templated; the limits can be changed in one place.
The table of bad inputs (`bad_inputs.py`) holds one case per limit; this file checks what the
table cannot: when the refusal happens, and configured limits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.openai.limits import RequestLimits
from tests.deploy.openai.openai_harness import MAX_MODEL_LEN, MODEL, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


class SpyTokenizer:
    """The tokenizer, recording every tokenization and chat-template render."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.work: list[str] = []

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.work.append("tokenize")
        return self._tok(*args, **kw)

    def apply_chat_template(self, *args: Any, **kw: Any) -> Any:
        self.work.append("template")
        return self._tok.apply_chat_template(*args, **kw)

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def _post(h: Any, path: str, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with h.client() as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def test_oversized_prompts_are_refused_before_tokenizing(tokenizer: Any) -> None:
    """Text with more UTF-8 bytes than the context could hold (8 per token), more token ids
    than the context holds, or chat messages over the byte budget: a 400 naming the field
    (`context_length_exceeded`), and the tokenizer and chat template never run."""
    spy = SpyTokenizer(tokenizer)
    h = make_harness(spy, max_request_bytes=1 << 20)
    spy.work.clear()  # the service warms the tokenizer up once
    budget = RequestLimits().prompt_bytes(MAX_MODEL_LEN)
    cases = [
        ("/v1/completions", {"prompt": "é" * (budget // 2 + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x" * (budget + 1)]}, "prompt.1"),
        ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (budget // 2)}] * 3}, "messages"),
    ]
    for path, body, param in cases:
        r = _post(h, path, {"model": MODEL, "max_tokens": 1, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
    assert spy.work == []
    ok = _post(h, "/v1/completions", {"model": MODEL, "prompt": "é" * 100, "max_tokens": 1})
    assert ok.status_code in (200, 400) and spy.work == ["tokenize"]  # within the budget: tokenized


def test_counts_are_refused_before_templating(tokenizer: Any) -> None:
    """Too many messages, tools, or tool calls in one message: a 400 naming the field before the
    chat template runs over them."""
    spy = SpyTokenizer(tokenizer)
    h = make_harness(spy, max_request_bytes=1 << 20)
    spy.work.clear()  # the service warms the tokenizer up once
    tool = {"type": "function", "function": {"name": "f"}}
    call = {"function": {"name": "f", "arguments": "{}"}}
    cases = [
        ({"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 129}, "tools"),
        ({"messages": [{"role": "assistant", "tool_calls": [call] * 129}]}, "messages.0.tool_calls"),
    ]
    for body, param in cases:
        r = _post(h, "/v1/chat/completions", {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert spy.work == []


def test_configured_limits_apply(tokenizer: Any) -> None:
    """`ServiceOptions.limits` sets every limit: a message or a grammar one byte over its
    configured size is a 400 naming it; at the size it passes the check."""
    limits = RequestLimits(message_bytes=100, grammar_bytes=64, stop=2)
    h = make_harness(tokenizer, limits=limits, max_model_len=512)
    chat = {"model": MODEL, "max_tokens": 1}
    over = _post(h, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "é" * 50 + "x"}]})
    assert over.status_code == 400 and over.json()["error"]["param"] == "messages.0", over.text
    at = _post(h, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "é" * 50}]})
    assert at.status_code == 200, at.text
    plain = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for field, value in [("guided_regex", "a" * 65), ("guided_choice", ["x" * 31, "y" * 32]),
                         ("guided_json", {"enum": ["z" * 60]}), ("stop", ["a", "b", "c"])]:  # fmt: skip
        r = _post(h, "/v1/completions", {**plain, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert _post(h, "/v1/completions", {**plain, "guided_regex": "a" * 64}).status_code == 200

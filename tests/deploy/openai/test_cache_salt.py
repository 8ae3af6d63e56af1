"""`cache_salt` over HTTP through the in-process ingress (docs/design.md §9.10): the field reaches
the engine in every choice's parameters, on completions and chat; the same prompt under another
salt (or none) reports no cached tokens, under the same salt it does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.events import salted_root
from tests.deploy.openai.openai_harness import MODEL, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir

PROMPT = list(range(1, 41))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def test_salted_prompts_report_cached_tokens_only_within_their_salt(tokenizer: Any) -> None:
    """A, then B, then no salt: nothing cached; A again: cached; every engine request (both
    choices of n=2) carried its request's salt."""
    h = make_harness(tokenizer)

    async def go() -> list[int]:
        cached = []
        async with h.client() as c:
            for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2}
                if salt is not None:
                    body["cache_salt"] = salt
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached

    first_a, b, none, again_a = asyncio.run(go())
    assert first_a == b == none == 0 and again_a > 0
    salts = [p.cache_salt for _, p, _ in h.engines[0].seen]
    assert salts == ["tenant-a"] * 2 + ["tenant-b"] * 2 + [None] * 2 + ["tenant-a"] * 2


def test_chat_carries_the_salt(tokenizer: Any) -> None:
    """A chat request's salt reaches the engine as its root hash."""
    h = make_harness(tokenizer)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "cache_salt": "tenant-c"}  # fmt: skip

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    (_, params, _), = h.engines[0].seen
    assert params.root_hash == salted_root("tenant-c")

"""The HTTP traffic of `swaserve bench routing --real`: tenants and chats against a live stack.

- tenants: `/v1/completions` with token ids = the tenant's system prompt + a short user turn;
- chats: `/v1/chat/completions`, each turn re-sending the whole conversation as text (as real
  clients do; the server tokenizes it again, so the cached prefix ends where the tokens agree).

Every request streams (`stream_options.include_usage`), so one response gives the time to the
first chunk with text, `usage.prompt_tokens_details.cached_tokens`, and the headers
`x-swaserve-predicted-cached-tokens` and `x-swaserve-replica`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from deploy.openai.headers import PREDICTED_CACHED_TOKENS_HEADER, REPLICA_HEADER
from worker.models.model_dir import TINY

MODEL = TINY
_WORDS = ("river stone light garden window paper music field cloud table mountain bridge "
          "silver yellow quiet rapid ancient modern little simple open close north south").split()  # fmt: skip


@dataclass(frozen=True)
class Traffic:
    tenants: int = 3
    tenant_requests: int = 9
    system_tokens: int = 320
    user_tokens: tuple[int, int] = (16, 48)
    chats: int = 2
    turns: int = 3
    chat_words: tuple[int, int] = (30, 60)
    max_tokens: int = 8
    concurrency: int = 1  # one at a time: the comparison then does not hinge on timing
    vocab: int = 1024  # the tiny model's; ids below 16 (special tokens) are never sent
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    kind: str  # "tenant" | "chat"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    predicted: int | None  # the router's prediction (header), None when absent
    replica: str
    ttft_s: float
    latency_s: float


async def run_traffic(url: str, t: Traffic, headers: dict[str, str]) -> list[Sample]:
    """Send every tenant request and chat turn; returns one `Sample` per request."""
    import httpx

    rng = random.Random(t.seed)
    systems = [
        [rng.randrange(16, t.vocab) for _ in range(t.system_tokens)] for _ in range(t.tenants)
    ]
    gate = asyncio.Semaphore(t.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:

        async def tenant(i: int) -> Sample:
            r = random.Random(f"{t.seed}/tenant/{i}")
            ids = systems[i % t.tenants] + [
                r.randrange(16, t.vocab) for _ in range(r.randint(*t.user_tokens))
            ]
            async with gate:
                return await _stream(client, "/v1/completions", {"prompt": ids}, "tenant", t)

        async def chat(c: int) -> list[Sample]:
            r = random.Random(f"{t.seed}/chat/{c}")
            messages = [{"role": "system", "content": _text(random.Random(t.seed), (80, 80))}]
            out = []
            for _ in range(t.turns):
                messages.append({"role": "user", "content": _text(r, t.chat_words)})
                async with gate:
                    sample, answer = await _stream_chat(client, messages, t)
                out.append(sample)
                messages.append({"role": "assistant", "content": answer})
            return out

        jobs = [tenant(i) for i in range(t.tenant_requests)]
        results = await asyncio.gather(*jobs, *(chat(c) for c in range(t.chats)))
    flat: list[Sample] = []
    for r in results:
        if isinstance(r, list):
            flat.extend(r)
        else:
            assert isinstance(r, Sample)
            flat.append(r)
    return flat


def _text(rng: random.Random, words: tuple[int, int]) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*words)))


def _body(extra: dict[str, Any], t: Traffic) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": t.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip


async def _stream(client: Any, path: str, extra: dict[str, Any], kind: str, t: Traffic) -> Sample:
    sample, _ = await _stream_any(client, path, _body(extra, t), kind)
    return sample


async def _stream_chat(
    client: Any, messages: list[dict[str, str]], t: Traffic
) -> tuple[Sample, str]:
    return await _stream_any(
        client, "/v1/chat/completions", _body({"messages": list(messages)}, t), "chat"
    )


async def _stream_any(
    client: Any, path: str, body: dict[str, Any], kind: str
) -> tuple[Sample, str]:
    t0 = time.perf_counter()
    first: float | None = None
    text, usage = [], None
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"{path} answered {resp.status_code}: {(await resp.aread())[:300]!r}"
            )
        predicted = resp.headers.get(PREDICTED_CACHED_TOKENS_HEADER)
        replica = resp.headers.get(REPLICA_HEADER, "?")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{path} streamed an error: {chunk['error']}")
            piece = _piece(chunk)
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{path} sent no usage chunk (stream_options.include_usage)")
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    sample = Sample(kind, usage["prompt_tokens"], int(details.get("cached_tokens", 0)),
                    usage["completion_tokens"], int(predicted) if predicted else None, replica,
                    (first or end) - t0, end - t0)  # fmt: skip
    return sample, "".join(text)


def _piece(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""

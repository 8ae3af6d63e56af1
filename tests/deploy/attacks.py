"""The hostile client of the bystander test: the worst inputs found for the server, each at its
largest accepted size and just past its limit (README "Limits", `deploy/openai/limits.py`), plus
the connection-level ones (a stream dropped after its first token, a half-sent body).

`attack_pass` sends every attack once, one at a time, as one client does, in a process of its own
(`spawn`): its JSON building and its reading of large answers then take none of the measuring
process's GIL. Loopback only; every request is bounded by a client timeout, so a pass ends by
itself. Each outcome records whether the answer was one the attack expects (`expected`): a 200
for an accepted request, the documented 400 / 413 for a refused one, a closed connection for a
dropped one; never a 5xx, a reset or a hang.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

MODEL = "tiny"
CONTEXT = 4096  # the tiny model's max_model_len
VOCAB = 1024  # the tiny tokenizer's
BYTE_TOKEN = 100  # a byte-fallback token of the tiny vocabulary: its text alone is U+FFFD
PROMPT_BYTES = 8 * CONTEXT  # RequestLimits.prompt_bytes
MAX_BODY = 4 * 1024 * 1024  # ServeConfig.max_request_bytes' default
CLIENT_TIMEOUT_S = 120.0
DROPPED = 0  # status of an attack that drops its own connection


@dataclass(frozen=True)
class Attack:
    name: str
    path: str
    body: bytes
    expect: frozenset[int]  # statuses that are the right answer
    mode: str = "plain"  # "plain" | "stream" (read to the end) | "drop" (close after one event) | "half" (half a body)


@dataclass
class Outcome:
    name: str
    status: int
    started: float  # time.monotonic() (system-wide: comparable across processes)
    seconds: float
    expected: bool
    error: str = ""


def _text(n_bytes: int) -> str:
    words = " ".join(f"w{i % 997}" for i in range(n_bytes // 3 + 1))
    return words[:n_bytes]


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 8, "ignore_eos": True, **fields}


def _chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **fields}


def _tools(n: int) -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"]}  # fmt: skip
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(n)]


def _choices(total_bytes: int) -> list[str]:
    """guided_choice options adding up to `total_bytes` of grammar (the grammar limit counts
    each choice's bytes and one separator)."""
    out, size, i = [], 0, 0
    while size + 32 <= total_bytes:
        out.append(f"choice-{i:024d}")  # 31 bytes, 32 counted
        size, i = size + 32, i + 1
    return out


OK, BAD, TOO_BIG = frozenset({200}), frozenset({400}), frozenset({413})


def attacks(salt: str) -> list[Attack]:
    """Every attack of a pass, accepted ones at their largest, refused ones just past. Every
    completion and chat carries `salt` as its `cache_salt`: a pass with a salt of its own finds
    nothing of an earlier pass in the cache, so it pays every prefill again."""

    def comp(**fields: Any) -> dict[str, Any]:
        return _completion(**{"cache_salt": salt, **fields})

    def chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return _chat(messages, **{"cache_salt": salt, **fields})

    c, ch = "/v1/completions", "/v1/chat/completions"
    hi = {"role": "user", "content": "hi"}
    stops = [f"never-{i:02d}-" + "z" * 54 for i in range(32)]  # 64 characters each, never generated
    return [
        # -- accepted, at the limit --------------------------------------------------------------
        Attack("/tokenize of text at the prompt byte limit", "/tokenize", _j({"prompt": _text(PROMPT_BYTES)}), OK),
        Attack("/detokenize of a context of byte tokens", "/detokenize", _j({"tokens": [BYTE_TOKEN] * CONTEXT}), OK),
        Attack("prompt text at the byte limit (tokenized, then too long)", c,
               _j(comp(prompt=_text(PROMPT_BYTES))), BAD),
        Attack("prompt ids filling the context", c, _j(comp(prompt=[5 + i % 900 for i in range(CONTEXT - 9)])), OK),
        # the chat template and tokenizer run on these whole, then the prompt is longer than the context
        Attack("chat of 2,048 messages (templated, then too long)", ch, _j(chat([hi] * 2048)), BAD),
        Attack("chat message at the prompt byte limit (templated, then too long)", ch,
               _j(chat([{"role": "user", "content": _text(PROMPT_BYTES - 64)}])), BAD),
        Attack("32 stop strings of 64 characters, 256 tokens", c, _j(comp(stop=stops, max_tokens=256)), OK),
        Attack("1,024 stop_token_ids, banned for 32 tokens", c,
               _j(comp(stop_token_ids=list(range(300, VOCAB)) + [VOCAB - 1] * 300, min_tokens=32, max_tokens=64)),
               OK),
        Attack("1,024 logit_bias entries, 128 tokens", c,
               _j(comp(logit_bias={str(i): 0.5 for i in range(VOCAB)}, max_tokens=128)), OK),
        Attack("logit_bias forcing a byte token, 1,024 tokens streamed", c,
               _j(comp(logit_bias={str(BYTE_TOKEN): 100}, max_tokens=1024, stream=True)), OK, mode="stream"),
        Attack("echo with 20 logprobs of a 2,000-token prompt", c,
               _j(comp(prompt=[5 + i % 900 for i in range(2000)], echo=True, logprobs=20, max_tokens=1)), OK),
        Attack("16 prompts x best_of 16 (256 sequences)", c,
               _j(comp(prompt=[[5 + p, 6, 7, 8, 9, 10, 11, 12] for p in range(16)], best_of=16, n=1,
                              max_tokens=4, temperature=1.0)), OK),
        Attack("128 tools, a call required", ch,
               _j(chat([hi], tools=_tools(128), tool_choice="required", max_tokens=32)), OK),
        Attack("guided_choice of 256 KiB", c, _j(comp(guided_choice=_choices(256 << 10), max_tokens=16)), OK),
        Attack("a self-referencing schema", c, _j(comp(guided_json={
            "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
            "$ref": "#/$defs/a"})), BAD),
        Attack("a stream dropped after its first token", c, _j(comp(max_tokens=2048, stream=True)),
               frozenset({DROPPED}), mode="drop"),
        Attack("half a body, then silence", c, _j(comp()), frozenset({DROPPED}), mode="half"),
        # -- refused, just past the limit ------------------------------------------------------
        Attack("/tokenize one byte past the limit", "/tokenize", _j({"prompt": _text(PROMPT_BYTES + 1)}), BAD),
        Attack("prompt text one byte past the limit", c, _j(comp(prompt=_text(PROMPT_BYTES + 1))), BAD),
        Attack("prompt ids of a whole context", c, _j(comp(prompt=[5] * CONTEXT)), BAD),
        Attack("chat of 2,049 messages", ch, _j(chat([hi] * 2049)), BAD),
        Attack("33 stop strings", c, _j(comp(stop=[*stops, "x"])), BAD),
        Attack("a stop string of 65 characters", c, _j(comp(stop=["z" * 65])), BAD),
        Attack("1,025 stop_token_ids", c, _j(comp(stop_token_ids=[5] * 1025)), BAD),
        Attack("1,025 logit_bias entries", c, _j(comp(logit_bias={str(i): 1 for i in range(1025)})), BAD),
        Attack("a logit_bias key of 5,000 digits", c, _j(comp(logit_bias={"1" * 5000: 1})), BAD),
        Attack("129 tools", ch, _j(chat([hi], tools=_tools(129))), BAD),
        Attack("guided_choice one choice past 256 KiB", c,
               _j(comp(guided_choice=[*_choices(256 << 10), "x" * 64])), BAD),
        Attack("guided_json nested 1,500 deep", c, _j(comp(guided_json="[" * 1500 + "]" * 1500)), BAD),
        Attack("best_of 17", c, _j(comp(best_of=17)), BAD),
        Attack("a cache_salt of 257 characters", c, _j(comp(cache_salt="s" * 257)), BAD),
        Attack("a body one byte past max_request_bytes", c, b" " * (MAX_BODY + 1), TOO_BIG),
    ]  # fmt: skip


# ---- one pass -----------------------------------------------------------------------------------


def attack_pass(url: str, salt: str, out: Any) -> None:
    """Send every attack once (a `spawn` process target); put the outcomes (dicts) on `out`."""
    outcomes = asyncio.run(_pass(url, attacks(salt)))
    out.put([asdict(o) for o in outcomes])


async def _pass(url: str, todo: list[Attack]) -> list[Outcome]:
    outcomes = []
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        for attack in todo:
            outcomes.append(await _send(http, url, attack))
    return outcomes


async def _send(http: httpx.AsyncClient, url: str, attack: Attack) -> Outcome:
    t0 = time.monotonic()
    run: Callable[[], Any] = {
        "plain": lambda: _plain(http, attack),
        "stream": lambda: _stream(http, attack, drop=False),
        "drop": lambda: _stream(http, attack, drop=True),
        "half": lambda: _half(url, attack),
    }[attack.mode]
    try:
        status = await asyncio.wait_for(run(), CLIENT_TIMEOUT_S)
        error = ""
    except (asyncio.TimeoutError, httpx.HTTPError) as e:
        status, error = -1, repr(e)[:200]
    return Outcome(attack.name, status, t0, time.monotonic() - t0, status in attack.expect, error)


_JSON = {"content-type": "application/json"}


async def _plain(http: httpx.AsyncClient, attack: Attack) -> int:
    r = await http.post(attack.path, content=attack.body, headers=_JSON)
    r.read()
    return r.status_code


async def _stream(http: httpx.AsyncClient, attack: Attack, drop: bool) -> int:
    """Read the stream to `[DONE]` (a 200 without it is no 200), or drop it after the first
    event (DROPPED when there was one)."""
    async with http.stream("POST", attack.path, content=attack.body, headers=_JSON) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line
                if drop:
                    return DROPPED
        return 200 if last == "data: [DONE]" else -2


async def _half(url: str, attack: Attack) -> int:
    """Headers announcing the whole body, half of it, a pause, then the connection closed."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST {attack.path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(attack.body)}\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + attack.body[: len(attack.body) // 2])
    await writer.drain()
    await asyncio.sleep(1.0)  # a client that stalls mid-body, then goes away
    writer.close()
    await writer.wait_closed()
    return DROPPED

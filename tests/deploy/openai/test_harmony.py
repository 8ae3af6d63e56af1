"""GPT-OSS chats in harmony (openai-harmony): the prompt rendering, the output parsed into
reasoning_content / content / tool_calls (streamed too), and the vocabulary file written from a
model's tokenizer.json byte-identical to o200k_base (harmony checks its hash).

The o200k_base vocabulary comes from the `bpe-openai` package (a dev dependency that ships it);
engines are fakes that emit a scripted harmony completion."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.openai import harmony
from tests.deploy.openai.openai_harness import MODEL, make_harness

COMPLETION = (
    "<|channel|>analysis<|message|>The user wants weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!<|return|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    spec = importlib.util.find_spec("bpe_openai")
    assert spec is not None and spec.submodule_search_locations, "install the dev extra (bpe-openai)"
    packed = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"
    folder = tmp_path_factory.mktemp("o200k")
    (folder / harmony.VOCAB_FILE).write_bytes(gzip.decompress(packed.read_bytes()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(harmony.ENCODINGS_ENV, str(folder))
        yield folder


class HarmonyTokenizer:
    """The ingress's tokenizer interface over the harmony encoding (GPT-OSS's vocabulary)."""

    chat_template = None

    def __init__(self, encoding: Any) -> None:
        self.enc = encoding

    def __len__(self) -> int:
        return 201_088

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(self.enc.encode(text, allowed_special="all"))}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        keep = [t for t in ids if not (skip_special_tokens and self.enc.is_special_token(t))]
        return str(self.enc.decode(keep))


def _chat(vocab_dir: Path, script: str) -> tuple[Any, Any]:
    enc = harmony.load_encoding(None)
    tok = HarmonyTokenizer(enc)
    fmt = harmony.HarmonyChat(tok, None, enc)
    h = make_harness(tok, script=list(enc.encode(script, allowed_special="all")), chat_format=fmt, max_model_len=2048)
    return h, fmt


def _post(h: Any, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 64, **body})

    return asyncio.run(go())


def test_prompt_renders_harmony_with_tools_and_history(vocab_dir: Path) -> None:
    """System (reasoning effort), developer (instructions + tools), the turns, tool results by
    name; the engine is told to stop at <|call|> and <|return|>."""
    h, fmt = _chat(vocab_dir, ANSWER)
    msgs = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]  # fmt: skip
    r = _post(h, {"messages": msgs, "tools": TOOLS, "reasoning_effort": "high"})
    assert r.status_code == 200, r.text
    rid, params, _ = h.engines[0].seen[0]
    prompt = fmt.encoding.decode(h.engines[0]._history[0][1])
    assert "Reasoning: high" in prompt and "Be terse." in prompt and "get_weather" in prompt
    assert "to=functions.get_weather" in prompt and "functions.get_weather to=assistant" in prompt
    assert prompt.endswith("<|start|>assistant")
    assert set(fmt.stop_token_ids) <= set(params.stop_token_ids)


def test_reasoning_content_and_tool_calls_parsed(vocab_dir: Path) -> None:
    """Analysis → reasoning_content; a commentary message to functions.X → a tool call."""
    h, _ = _chat(vocab_dir, COMPLETION)
    body = _post(h, {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}).json()
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants weather."
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert body["choices"][0]["finish_reason"] == "tool_calls" and "content" not in msg


def test_final_channel_streams_as_content(vocab_dir: Path) -> None:
    """Streamed: reasoning deltas first, then content deltas, joined they equal the message."""
    h, _ = _chat(vocab_dir, ANSWER)
    r = _post(h, {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Easy."
    assert "".join(d.get("content") or "" for d in deltas) == "Hi there!"


def test_vocab_file_from_a_tokenizer_json_is_byte_identical(vocab_dir: Path, tmp_path: Path) -> None:
    """A byte-level BPE tokenizer.json holding o200k_base's ranks gives back its exact file."""
    original = (vocab_dir / harmony.VOCAB_FILE).read_bytes()
    to_char = {b: c for c, b in harmony._byte_decoder().items()}
    vocab = {}
    for line in original.decode().splitlines():
        token, rank = line.split()
        vocab["".join(to_char[b] for b in base64.b64decode(token))] = int(rank)
    vocab["<|endoftext|>"] = 199_999
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    harmony.write_vocab(tmp_path / "tokenizer.json", tmp_path / harmony.VOCAB_FILE)
    written = (tmp_path / harmony.VOCAB_FILE).read_bytes()
    assert hashlib.sha256(written).digest() == hashlib.sha256(original).digest()


def test_openai_client_reads_reasoning_and_calls(vocab_dir: Path) -> None:
    """Through the openai package, streamed and not: reasoning_content, the tool call, its
    finish reason."""
    import httpx
    import openai

    h, _ = _chat(vocab_dir, COMPLETION)

    async def go() -> tuple[Any, list[Any]]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://ingress")
        async with openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="x", http_client=http) as c:
            kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                                  "tools": TOOLS, "max_tokens": 64}  # fmt: skip
            whole = await c.chat.completions.create(**kw)
            chunks = [x async for x in await c.chat.completions.create(stream=True, **kw)]
            return whole, chunks

    whole, chunks = asyncio.run(go())
    msg = whole.choices[0].message
    assert msg.reasoning_content == "The user wants weather." and msg.tool_calls[0].function.name == "get_weather"  # type: ignore[attr-defined]
    deltas = [x.delta for ch in chunks for x in ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants weather."
    assert [tc.function.arguments for d in deltas for tc in (d.tool_calls or [])] == ['{"city": "Oslo"}']
    assert [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason] == ["tool_calls"]


def test_template_kwargs_carry_only_the_reasoning_effort(vocab_dir: Path) -> None:
    """chat_template_kwargs.reasoning_effort sets the level; any other key is a 400 naming it."""
    h, fmt = _chat(vocab_dir, ANSWER)
    msgs = [{"role": "user", "content": "Hi"}]
    ok = _post(h, {"messages": msgs, "chat_template_kwargs": {"reasoning_effort": "low"}})
    bad = _post(h, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
    assert ok.status_code == 200 and "Reasoning: low" in fmt.encoding.decode(h.engines[0]._history[0][1])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"

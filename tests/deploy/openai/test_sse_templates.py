"""A streamed chunk that carries only text is written from a template (no pydantic model per
token): its bytes must equal `from_model` of the chunk the model path builds, for completions
and chat, with and without a finish reason, for any text (quotes, control characters, non-ASCII)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.outputs import StreamDelta
from deploy.openai.bodies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from deploy.openai.choices import ChoiceState
from deploy.openai.detokenize import StopTextStream
from deploy.openai.responses import ResponseBuilder, Shape
from deploy.openai.streaming import from_model

TEXTS = ["", "hello", ' "quoted" \\ /', "".join(chr(i) for i in range(32)) + "\x7f", "é漢字\u2028\U0001f600\ufffd"]


def _choice(index: int) -> ChoiceState:
    return ChoiceState(index, 0, f"r-{index}", text=None)  # type: ignore[arg-type]  # not read


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("finish", [None, "length", "stop"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_chunk_from_the_template_equals_the_model_path(chat: bool, finish: str | None, text: str) -> None:
    b = ResponseBuilder(None, 'cmpl-"1', 'model "é"', chat, Shape(), [[1, 2]])
    c = _choice(3)
    chunk: Any
    if chat:
        delta = ChatDelta(content=text or None)
        chunk = ChatCompletionChunk(id=b.id, created=b.created, model=b.model,
                                    choices=[ChatChunkChoice(index=3, delta=delta, finish_reason=finish)])  # fmt: skip
    else:
        chunk = CompletionResponse(id=b.id, created=b.created, model=b.model,
                                   choices=[CompletionChoice(index=3, text=text, finish_reason=finish)])  # fmt: skip
    assert b._text_event(c, text, finish) == from_model(chunk)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tests.fakes.tokenizer import make_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _delta(ids: list[int], done: bool) -> StreamDelta:
    return StreamDelta("r-0", ids, done, "length" if done else None, 2, 0, len(ids))


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_completion_delta_whose_text_is_held_back_still_gets_its_chunk(tokenizer: Any, logprobs: bool) -> None:
    """Tokens whose text waits (here: a stop string's prefix) are sent as a chunk with empty
    text, as vLLM does, so a client times the first token when the engine made it; the held
    text comes with a later chunk, and the texts add up to the whole."""
    ids = tokenizer(" sli")["input_ids"]
    b = ResponseBuilder(tokenizer, "cmpl-1", "m", False, Shape(logprobs=logprobs), [[1, 2]])
    c = ChoiceState(0, 0, "r-0", StopTextStream(tokenizer, ["sliding"]))
    events = [b.event(c, _delta([t], done=i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert all(e is not None for e in events), events
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events if e is not None]
    assert texts[0] == "" and "".join(texts) == " sli"

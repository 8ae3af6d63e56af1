"""A streamed chunk that carries only text is written from a template (no pydantic model per
token): its bytes must equal `from_model` of the chunk the model path builds, for completions
and chat, with and without a finish reason, for any text (quotes, control characters, non-ASCII)."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.openai.bodies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from deploy.openai.choices import ChoiceState
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

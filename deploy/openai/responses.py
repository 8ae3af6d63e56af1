"""Builds the OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from deploy.openai.choices import ChoiceState, chat_logprobs, completion_logprobs
from deploy.openai.schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
    now,
)
from worker.outputs import StreamDelta


class ResponseBuilder:
    def __init__(self, tokenizer: Any, response_id: str, model: str, chat: bool) -> None:
        self._tok = tokenizer
        self.id = response_id
        self.model = model
        self.chat = chat
        self.created = now()
        self._offsets: dict[int, int] = {}  # choice index -> text offset (completion logprobs)

    def final(self, choices: Sequence[ChoiceState], usage: Usage) -> BaseModel:
        ordered = sorted(choices, key=lambda c: c.index)
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, usage=usage,
                choices=[
                    ChatChoice(
                        index=c.index, message=ChatMessageOut(content=c.text.text),
                        finish_reason=c.finish_reason,
                        logprobs=chat_logprobs(self._tok, c.logprobs) if c.logprobs else None,
                    )
                    for c in ordered
                ],
            )  # fmt: skip
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[
                CompletionChoice(
                    index=c.index, text=c.text.text, finish_reason=c.finish_reason,
                    logprobs=completion_logprobs(self._tok, c.logprobs, 0) if c.logprobs else None,
                )
                for c in ordered
            ],
        )  # fmt: skip

    def first_chunk(self, c: ChoiceState) -> BaseModel:
        choice = ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def chunk(self, c: ChoiceState, text: str, delta: StreamDelta) -> BaseModel | None:
        """The chunk for one delta, or None when it carries nothing the client can see yet."""
        finish = c.finish_reason
        lps = delta.logprobs or []
        if not text and finish is None and not lps:
            return None
        if self.chat:
            choice = ChatChunkChoice(
                index=c.index, delta=ChatDelta(content=text), finish_reason=finish,
                logprobs=chat_logprobs(self._tok, lps) if lps else None,
            )  # fmt: skip
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        offset = self._offsets.get(c.index, 0)
        logprobs = completion_logprobs(self._tok, lps, offset) if lps else None
        if logprobs is not None:
            self._offsets[c.index] = offset + sum(len(t) for t in logprobs.tokens)
        text_choice = CompletionChoice(index=c.index, text=text, finish_reason=finish, logprobs=logprobs)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[text_choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        if self.chat:
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

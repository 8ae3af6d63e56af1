"""Builds the OpenAI response bodies and stream chunks for completions and chat completions.

Completions with `echo` put the prompt's text (and, with `logprobs`, its tokens' logprobs, the
first one null) before the completion; chat choices carry what their `ChatParser` made of the
text: content, `reasoning_content`, `tool_calls` (finish reason `tool_calls` then).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.outputs import StreamDelta, TokenLogprob
from deploy.openai.bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    now,
)
from deploy.openai.choices import (
    ChoiceState,
    OffsetTracker,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from deploy.openai.detokenize import IncrementalDetokenizer
from deploy.openai.streaming import from_model
from deploy.openai.tools import ChatPiece


@dataclass(frozen=True)
class Shape:
    """What the client asked to see."""

    logprobs: bool = False  # completion/chat token logprobs
    echo: bool = False
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    skip_special_tokens: bool = True


class ResponseBuilder:
    def __init__(
        self, tokenizer: Any, response_id: str, model: str, chat: bool, shape: Shape, prompts: list[list[int]]
    ) -> None:
        self._tok = tokenizer
        self.id = response_id
        self.model = model
        self.chat = chat
        self.shape = shape
        self.created = now()
        self._prompts = prompts
        self._offsets: dict[int, OffsetTracker] = {}  # choice index -> offsets of its tokens
        self._started: set[int] = set()  # completion choices whose first chunk went out
        # Every chunk's JSON up to its first choice's index: a text-only chunk is this, the
        # index and the text (`_text_event`), no pydantic model built per token.
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_json(response_id)},"object":"{kind}","created":{self.created},'
                      f'"model":{_json(model)},"choices":[{{"index":')  # fmt: skip

    # -- completions ---------------------------------------------------------------------------

    def _echo(self, c: ChoiceState) -> tuple[str, OffsetTracker]:
        """The echoed prompt text, and an offset tracker positioned after it."""
        ids = self._prompts[c.prompt_index]
        detok = IncrementalDetokenizer(self._tok, None, self.shape.skip_special_tokens)
        text = detok.push(ids, final=True)
        return text, OffsetTracker(self._tok, 0, None, self.shape.skip_special_tokens)

    def _completion_logprobs(self, c: ChoiceState, ids: Sequence[int], lps: Sequence[TokenLogprob | None],
                             echo_first: bool) -> CompletionLogprobs:  # fmt: skip
        if c.index not in self._offsets:
            start = len(self._echo(c)[0]) if self.shape.echo else 0
            context = self._prompts[c.prompt_index][-4:]
            self._offsets[c.index] = OffsetTracker(self._tok, start, context, self.shape.skip_special_tokens)
        out = CompletionLogprobs()
        if echo_first:
            prompt_ids = self._prompts[c.prompt_index]
            _, tracker = self._echo(c)
            out = completion_logprobs(self._tok, c.prompt_logprobs or [None] * len(prompt_ids), prompt_ids, tracker)
        gen = completion_logprobs(self._tok, lps, ids, self._offsets[c.index])
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(out, name).extend(getattr(gen, name))
        return out

    def _completion_choice(self, c: ChoiceState, text: str, ids: Sequence[int], lps: Sequence[TokenLogprob],
                           first: bool, final: bool) -> CompletionChoice:  # fmt: skip
        echo = self.shape.echo and first
        logprobs = None
        if self.shape.logprobs and (ids or echo):
            logprobs = self._completion_logprobs(c, ids, lps, echo)
        prompt_lps = None
        if self.shape.prompt_logprobs and first and c.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_body(self._tok, c.prompt_logprobs)
        prefix = self._echo(c)[0] if echo else ""
        return CompletionChoice(
            index=c.index, text=prefix + text, logprobs=logprobs, prompt_logprobs=prompt_lps,
            finish_reason=c.finish_reason if final else None,
        )  # fmt: skip

    # -- chat ----------------------------------------------------------------------------------

    def _chat_message(self, c: ChoiceState) -> ChatMessageOut:
        p = c.parser
        assert p is not None
        return ChatMessageOut(
            content=p.content if (p.content or not p.calls) else None,
            reasoning_content=p.reasoning or None,
            tool_calls=p.calls or None,
        )

    def finish_reason(self, c: ChoiceState) -> str | None:
        if self.chat and c.parser is not None and c.parser.calls and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    # -- bodies and chunks ---------------------------------------------------------------------

    def final(self, choices: Sequence[ChoiceState], usage: Usage) -> BaseModel:
        ordered = sorted(choices, key=lambda c: c.index)
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, usage=usage,
                choices=[
                    ChatChoice(
                        index=c.index, message=self._chat_message(c), finish_reason=self.finish_reason(c),
                        logprobs=chat_logprobs(self._tok, c.logprobs) if self.shape.logprobs else None,
                        prompt_logprobs=self._prompt_lps(c),
                    )
                    for c in ordered
                ],
            )  # fmt: skip
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[self._completion_choice(c, c.text.text, c.token_ids, c.logprobs, True, True) for c in ordered],
        )  # fmt: skip

    def _prompt_lps(self, c: ChoiceState) -> Any:
        if self.shape.prompt_logprobs and c.prompt_logprobs is not None:
            return prompt_logprobs_body(self._tok, c.prompt_logprobs)
        return None

    def first_chunk(self, c: ChoiceState) -> BaseModel:
        choice = ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def chat_chunk(self, c: ChoiceState, piece: ChatPiece, delta: StreamDelta, final: bool) -> BaseModel | None:
        """The chunk for one delta, or None when it carries nothing the client can see yet."""
        lps = (delta.logprobs or []) if self.shape.logprobs else []
        finish = self.finish_reason(c) if final else None
        if not piece and finish is None and not lps:
            return None
        choice = ChatChunkChoice(
            index=c.index,
            delta=ChatDelta(content=piece.content or None, reasoning_content=piece.reasoning or None,
                            tool_calls=piece.tool_calls or None),
            finish_reason=finish, logprobs=chat_logprobs(self._tok, lps) if lps else None,
        )  # fmt: skip
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def completion_chunk(self, c: ChoiceState, text: str, delta: StreamDelta, first: bool, final: bool) -> BaseModel | None:
        lps = delta.logprobs or []
        if not text and not delta.token_ids and not final and not (self.shape.logprobs and lps) and not (first and self.shape.echo):
            return None
        choice = self._completion_choice(c, text, delta.token_ids, lps, first, final)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _text_event(self, c: ChoiceState, text: str, finish: str | None) -> str:
        """`from_model` of the chunk of one choice that carries only its new text (and its
        finish reason): the same bytes (pydantic's field order, `exclude_none`, and JSON string
        escaping, which `json.dumps(ensure_ascii=False)` shares), from a template."""
        if self.chat:
            body = f'"delta":{{"content":{_json(text)}}}' if text else '"delta":{}'
        else:
            body = f'"text":{_json(text)}'
        end = f',"finish_reason":{_json(finish)}' if finish is not None else ""
        return f"{self._head}{c.index},{body}{end}}}]}}\n\n"

    # -- one worker delta, folded into its choice --------------------------------------------

    def fold(self, c: ChoiceState, delta: StreamDelta) -> None:
        """A non-streamed choice takes one delta (its text, counters and chat parser)."""
        piece = c.consume(delta)
        if c.parser is not None:
            c.parser.feed(piece.text, delta.token_ids)
            if c.done:
                c.parser.finish()

    def event(self, c: ChoiceState, delta: StreamDelta) -> str | None:
        """A streamed choice takes one delta; returns its SSE event, or None while the delta
        shows nothing yet (chat: text held back for a stop string or a whole character; a
        completion sends a chunk for every delta with tokens, its text maybe empty)."""
        piece = c.consume(delta)
        chunk: BaseModel | None
        if c.parser is not None:
            chat_piece = c.parser.feed(piece.text, delta.token_ids)
            if c.done:
                tail = c.parser.finish()
                chat_piece.content += tail.content
                chat_piece.reasoning += tail.reasoning
                chat_piece.tool_calls += tail.tool_calls
            finish = self.finish_reason(c) if c.done else None
            no_logprobs = not (self.shape.logprobs and delta.logprobs)
            if no_logprobs and not chat_piece.reasoning and not chat_piece.tool_calls:
                if not chat_piece.content and finish is None:
                    return None
                return self._text_event(c, chat_piece.content, finish)
            chunk = self.chat_chunk(c, chat_piece, delta, final=c.done)
        else:
            first = c.index not in self._started
            if not self.shape.logprobs and not (first and (self.shape.echo or self.shape.prompt_logprobs)):
                # NOTE: a delta of tokens whose text is held back (a character's first bytes, a
                # stop string's prefix) still gets its chunk, with empty text, as vLLM's does:
                # clients time the first token and the gaps by chunks, and holding it back made a
                # few first tokens look hundreds of ms late (BENCHMARKS "vllm-compare").
                if not piece.text and not delta.token_ids and not c.done:
                    return None
                self._started.add(c.index)
                return self._text_event(c, piece.text, c.finish_reason if c.done else None)
            chunk = self.completion_chunk(c, piece.text, delta, first=first, final=c.done)
            if chunk is not None:
                self._started.add(c.index)
        return None if chunk is None else from_model(chunk)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        if self.chat:
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)


def _json(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)

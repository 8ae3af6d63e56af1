"""One OpenAI "choice" = one worker request: its stream, text, counters, and its JSON pieces.

A request with `n` choices or a batch of prompts fans out into several `ChoiceState`s; usage sums
them (each prompt's tokens counted once, as OpenAI does for `n > 1`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.messages import StreamStart
from deploy.openai.detokenize import StopTextStream, TextPiece
from deploy.openai.schema import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from worker.outputs import StreamDelta, TokenLogprob


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    request: Any  # cluster.messages.RoutedRequest
    text: StopTextStream
    stream: AsyncIterator[StreamStart | StreamDelta] | None = None
    start: StreamStart | None = None
    replica: str = ""
    prompt_len: int = 0
    cached_tokens: int = 0
    repaired_tokens: int = 0  # recomputed to repair the cached prefix (docs/design.md §9.8)
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def consume(self, delta: StreamDelta) -> TextPiece:
        """Fold one delta in; returns the new text (cut at a stop string, if one appeared)."""
        piece = self.text.feed(delta.token_ids, final=delta.finished)
        self.prompt_len, self.cached_tokens = delta.prompt_len, delta.cached_tokens
        self.repaired_tokens = delta.repaired_tokens
        self.completion_tokens = delta.completion_tokens
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if piece.stopped:
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = delta.finish_reason or "stop"
        return piece

    async def close(self) -> None:
        """Stop the worker stream (a no-op when it already ended); frees the request's KV."""
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.aclose()  # type: ignore[attr-defined]


def usage_of(choices: Sequence[ChoiceState]) -> Usage:
    prompts: dict[int, tuple[int, int]] = {}
    for c in choices:
        prompt_len, cached = prompts.get(c.prompt_index, (0, 0))
        prompts[c.prompt_index] = (max(prompt_len, c.prompt_len), max(cached, c.cached_tokens))
    prompt_tokens = sum(p for p, _ in prompts.values())
    completion = sum(c.completion_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c for _, c in prompts.values())),
    )


async def merged(choices: Sequence[ChoiceState]) -> AsyncIterator[tuple[ChoiceState, StreamDelta]]:
    """Interleave the deltas of several choices in arrival order (one choice: no tasks)."""
    if len(choices) == 1:
        c = choices[0]
        assert c.stream is not None
        async for item in c.stream:
            yield c, item  # type: ignore[misc]
        return
    queue: asyncio.Queue[tuple[ChoiceState, StreamDelta | BaseException | None]] = asyncio.Queue()

    async def pump(c: ChoiceState) -> None:
        try:
            assert c.stream is not None
            async for item in c.stream:
                queue.put_nowait((c, item))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((c, e))
        finally:
            queue.put_nowait((c, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        live = len(tasks)
        while live:
            c, got = await queue.get()
            if got is None:
                live -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield c, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------------------------------------
# logprobs in OpenAI's two shapes


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def completion_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in lps:
        text = _token_text(tokenizer, lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_token_text(tokenizer, t): v for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    def top(t: int, v: float) -> TopLogprob:
        s = _token_text(tokenizer, t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

    content = []
    for lp in lps:
        head = top(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)

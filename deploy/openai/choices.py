"""One OpenAI "choice": its text, counters and logprobs, and their JSON shapes.

A request fans out into prompts × choices (`n`, or `best_of` of which the `n` most likely are
kept); each prompt is one worker stream (`deploy.openai.fanout`) that carries its choices'
deltas, told apart by request id. Usage sums them, each prompt's tokens counted once (as OpenAI
does for `n > 1`).

`text_offset` (completions logprobs) is where each token starts in the choice's text, as the
client sees it: a second per-token detokenizer with the same settings measures it, so a
special token that adds no text (skip_special_tokens) has the offset of the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.outputs import StreamDelta, TokenLogprob
from deploy.openai.bodies import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from deploy.openai.detokenize import IncrementalDetokenizer, StopTextStream, TextPiece
from deploy.openai.tools import ChatParser


@dataclass
class ChoiceState:
    index: int  # the response's choice index (reassigned after best_of ranking)
    prompt_index: int
    request_id: str  # the engine request this choice is
    text: StopTextStream
    parser: ChatParser | None = None  # chat only: content / reasoning / tool calls
    prompt_len: int = 0
    cached_tokens: int = 0
    repaired_tokens: int = 0  # recomputed to repair the cached prefix (docs/design.md §9.8)
    loaded_tokens: int = 0  # KV tokens of the cached prefix loaded from the host tier (§9.9)
    completion_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    def consume(self, delta: StreamDelta) -> TextPiece:
        """Fold one delta in; returns the new text (cut at a stop string, if one appeared)."""
        piece = self.text.feed(delta.token_ids, final=delta.finished)
        self.prompt_len, self.cached_tokens = delta.prompt_len, delta.cached_tokens
        self.repaired_tokens, self.loaded_tokens = delta.repaired_tokens, delta.loaded_tokens
        self.completion_tokens = delta.completion_tokens
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if piece.stopped:
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = delta.finish_reason or "stop"
        return piece


def usage_of(choices: Sequence[ChoiceState]) -> Usage:
    """Each prompt once; its cached tokens are what its first computation reused (the other
    choices reuse that computation, which is not a cache hit of the request)."""
    prompts: dict[int, tuple[int, int]] = {}
    for c in choices:
        prompt_len, cached = prompts.get(c.prompt_index, (0, c.cached_tokens))
        prompts[c.prompt_index] = (max(prompt_len, c.prompt_len), min(cached, c.cached_tokens))
    prompt_tokens = sum(p for p, _ in prompts.values())
    completion = sum(c.completion_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c for _, c in prompts.values())),
    )


def best_of(choices: Sequence[ChoiceState], prompts: Sequence[int], keep: int) -> list[ChoiceState]:
    """best_of > n: per prompt the `keep` choices with the highest cumulative logprob, reindexed
    (prompt * keep + rank); all of them when every prompt has exactly `keep`."""
    if len(choices) == keep * len(prompts):
        return list(choices)
    kept = []
    for p in prompts:
        mine = sorted((c for c in choices if c.prompt_index == p), key=lambda c: -c.cumulative_logprob)
        for rank, c in enumerate(mine[:keep]):
            c.index = p * keep + rank
            kept.append(c)
    return kept


# ----------------------------------------------------------------------------------------------
# logprobs in OpenAI's two shapes, and vLLM's prompt_logprobs


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


class OffsetTracker:
    """Per-token text offsets of a choice's tokens, as its detokenizer renders them."""

    def __init__(self, tokenizer: Any, start: int, context_ids: list[int] | None, skip_special: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special)
        self.offset = start

    def offsets(self, token_ids: Sequence[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self.offset)
            self.offset += len(self._detok.push([t]))
        return out


def completion_logprobs(
    tokenizer: Any, lps: Sequence[TokenLogprob | None], ids: Sequence[int], offsets: OffsetTracker
) -> CompletionLogprobs:
    """`lps[i]` is None for an echoed prompt's first token (no logprob, as OpenAI sends)."""
    out = CompletionLogprobs()
    out.text_offset = offsets.offsets(ids)
    for token, lp in zip(ids, lps):
        out.tokens.append(token_text(tokenizer, token))
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else {token_text(tokenizer, t): v for t, v in lp.top})
    return out


def chat_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    def top(t: int, v: float) -> TopLogprob:
        s = token_text(tokenizer, t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

    content = []
    for lp in lps:
        head = top(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


def prompt_logprobs_body(tokenizer: Any, lps: Sequence[TokenLogprob | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}."""
    out: PromptLogprobs = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, decoded_token=token_text(tokenizer, lp.token_id))}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(tokenizer, t)))
        out.append(entry)
    return out

"""Request checks that need more than the schema, and the request -> `SamplingParams` step.

Each failure is a 400 (404 for an unknown model) naming the parameter to change. The checks run
before the prompt is tokenized or templated: sizes against `RequestLimits`, token ids against
the vocabulary, and the prompt's bytes against what the context could hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.sampling_params import MAX_LOGIT_BIAS, Grammar, SamplingParams
from deploy.openai.limits import RequestLimits
from deploy.openai.schema import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    bad_request,
)

# A longer logit_bias key is outside any vocabulary, refused without int() (which raises
# ValueError past 4,300 digits: a 500 once).
_ID_DIGITS = 18


class RequestChecks:
    """The checks of one served model: its name, its vocabulary (stop token ids, logit_bias
    keys) and the limits (`RequestLimits`)."""

    def __init__(self, model_name: str, vocab_size: int, limits: RequestLimits) -> None:
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.limits = limits

    def completion(self, req: CompletionRequest, max_model_len: int) -> None:
        self._common(req)
        if req.suffix:
            raise bad_request("suffix is not supported; omit it", param="suffix")
        if req.best_of is not None:
            if req.best_of < req.n:
                raise bad_request(f"best_of ({req.best_of}) must be >= n ({req.n})", param="best_of")
            if req.stream and req.best_of > req.n:
                raise bad_request("best_of > n cannot be streamed (choices are ranked at the end)", param="best_of")
        self._prompt_size(req.prompt, max_model_len)

    def text(self, text: str, max_model_len: int) -> None:
        """Text to tokenize alone (`/tokenize`): the byte bound of a prompt."""
        self._prompt_size(text, max_model_len)

    def chat(self, req: ChatCompletionRequest, max_model_len: int) -> None:
        self._common(req)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        self._chat_size(req, max_model_len)

    # -- both endpoints ----------------------------------------------------------------------

    def _common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self.model_name:
            raise APIError(
                404, f"The model '{req.model}' does not exist; this server serves "
                f"'{self.model_name}' (see GET /v1/models)", param="model", code="model_not_found",
            )  # fmt: skip
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        self._stops(req.stop_list(), req.stop_token_ids or [])
        self._logit_bias(req.logit_bias or {})

    def _stops(self, stops: list[str], ids: list[int]) -> None:
        lim = self.limits
        _at_most(len(stops), lim.stop, "stop strings", "stop")
        longest = max(stops, key=len, default="")
        if len(longest) > lim.stop_chars:
            raise bad_request(f"stop strings may have at most {lim.stop_chars} characters; one has "
                              f"{len(longest)}", param="stop")  # fmt: skip
        _at_most(len(ids), lim.stop_token_ids, "stop_token_ids", "stop_token_ids")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})",
                              param="stop_token_ids")  # fmt: skip

    def _logit_bias(self, biases: dict[str, float]) -> None:
        _at_most(len(biases), self.limits.logit_bias, "logit_bias entries", "logit_bias")
        for key, bias in biases.items():
            # NOTE: str.isdigit() is true of "²" and other non-ASCII digits that int() refuses.
            if not (key.isascii() and key.isdigit()):
                raise bad_request(f"logit_bias keys must be token ids; got {key[:32]!r}", param="logit_bias")
            if len(key) > _ID_DIGITS or int(key) >= self.vocab_size:
                raise bad_request(f"logit_bias key {key[:32]} is outside the vocabulary [0, {self.vocab_size})",
                                  param="logit_bias")  # fmt: skip
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad_request(f"logit_bias values must be in [-100, 100]; got {bias}", param="logit_bias")

    # -- the prompt's size, before it is tokenized --------------------------------------------

    def _prompt_size(self, prompt: str | list[int] | list[str] | list[list[int]], max_model_len: int) -> None:
        """Text longer in bytes than the context could hold, or more ids than it holds, is refused
        before the tokenizer sees it (it would take the event loop for the whole text)."""
        items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        budget = self.limits.prompt_bytes(max_model_len)
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                _fits_bytes(len(item.encode()), budget, max_model_len, param)
            elif len(item) >= max_model_len:
                raise context_exceeded(len(item), max_model_len, param)

    def _chat_size(self, req: ChatCompletionRequest, max_model_len: int) -> None:
        lim = self.limits
        _at_most(len(req.messages), lim.messages, "messages", "messages")
        _at_most(len(req.tools or ()), lim.tools, "tools", "tools")
        total = sum(len(t.model_dump_json()) for t in req.tools or ())  # the template renders them
        for i, m in enumerate(req.messages):
            _at_most(len(m.tool_calls or ()), lim.tools, "tool calls per message", f"messages.{i}.tool_calls")
            size = _message_bytes(m)
            if size > lim.message_bytes:
                raise bad_request(f"messages.{i} is {size:,} bytes; at most {lim.message_bytes:,} per message",
                                  param=f"messages.{i}")  # fmt: skip
            total += size
        _fits_bytes(total, lim.prompt_bytes(max_model_len), max_model_len, "messages")


def _at_most(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise bad_request(f"at most {limit:,} {what} per request; got {count:,}", param=param)


def _message_bytes(m: ChatMessage) -> int:
    parts = [m.text(), m.name or "", m.tool_call_id or "", m.reasoning_content or ""]
    parts += [f"{c.id}{c.function.name}{c.function.arguments}" for c in m.tool_calls or ()]
    return sum(len(p.encode()) for p in parts)


def _fits_bytes(size: int, budget: int, max_model_len: int, param: str) -> None:
    if size > budget:
        raise bad_request(
            f"{param} is {size:,} bytes of text; this model's context of {max_model_len} tokens "
            f"holds at most about {budget:,} (refused before tokenizing); send less text",
            param=param, code="context_length_exceeded",
        )  # fmt: skip


def context_exceeded(prompt_len: int, max_model_len: int, param: str) -> APIError:
    return bad_request(
        f"prompt has {prompt_len} tokens; this model's context is {max_model_len} "
        f"tokens, so at most {max_model_len - 1} prompt tokens fit",
        param=param, code="context_length_exceeded",
    )  # fmt: skip


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int,
    grammar: Grammar | None,
    extra_stop_token_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's parameters for the first choice of one prompt; the context limit is checked
    here (400, code `context_length_exceeded`) so the client learns which number to lower."""
    chat = isinstance(req, ChatCompletionRequest)
    room = max_model_len - prompt_len
    if room < 1:
        raise context_exceeded(prompt_len, max_model_len, "messages" if chat else "prompt")
    if isinstance(req, ChatCompletionRequest):
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = room if limit is None else limit  # chat: up to the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompt_logprobs = req.prompt_logprobs
    else:
        max_tokens = default_max_tokens if req.max_tokens is None else req.max_tokens
        logprobs, name = req.logprobs, "max_tokens"
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        if (req.best_of or req.n) > req.n:
            logprobs = logprobs or 0  # ranking needs each token's logprob
    if max_tokens > room:
        raise bad_request(
            f"{name}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
            f"context of {max_model_len} tokens; ask for at most {room}",
            param=name, code="context_length_exceeded",
        )  # fmt: skip
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds {name} ({max_tokens})", param="min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=tuple(req.stop_list()),
        stop_token_ids=tuple(req.stop_token_ids or ()) + extra_stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
        grammar=grammar,
        cache_salt=req.cache_salt,
    )
    try:
        params.validate()
    except ValueError as e:  # the message starts with the parameter's name
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
    return params


def sibling_params(first: SamplingParams, k: int) -> SamplingParams:
    """Choice k > 0 of a prompt: its own seed (seed + k, as vLLM derives them) and no prompt
    logprobs (the first choice computes them; the others reuse its prefill)."""
    seed = None if first.seed is None else first.seed + k
    return dataclasses.replace(first, seed=seed, prompt_logprobs=None)

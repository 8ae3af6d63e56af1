"""Request checks that need more than the schema, and the request -> `SamplingParams` step.

Each failure is a 400 (404 for an unknown model) naming the parameter to change.
"""

from __future__ import annotations

import dataclasses

from core.sampling_params import MAX_LOGIT_BIAS, Grammar, SamplingParams
from deploy.openai.schema import APIError, ChatCompletionRequest, CompletionRequest, bad_request


def check_common(req: CompletionRequest | ChatCompletionRequest, model_name: str) -> None:
    if req.model != model_name:
        raise APIError(
            404, f"The model '{req.model}' does not exist; this server serves "
            f"'{model_name}' (see GET /v1/models)", param="model", code="model_not_found",
        )  # fmt: skip
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    for key, bias in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or int(key) < 0:
            raise bad_request(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be in [-100, 100]; got {bias}", param="logit_bias")


def check_completion(req: CompletionRequest, model_name: str) -> None:
    check_common(req, model_name)
    if req.suffix:
        raise bad_request("suffix is not supported; omit it", param="suffix")
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"best_of ({req.best_of}) must be >= n ({req.n})", param="best_of")
        if req.stream and req.best_of > req.n:
            raise bad_request("best_of > n cannot be streamed (choices are ranked at the end)", param="best_of")


def check_chat(req: ChatCompletionRequest, model_name: str) -> None:
    check_common(req, model_name)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")


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
        raise bad_request(
            f"prompt has {prompt_len} tokens; this model's context is {max_model_len} "
            f"tokens, so at most {max_model_len - 1} prompt tokens fit",
            param="messages" if chat else "prompt", code="context_length_exceeded",
        )  # fmt: skip
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

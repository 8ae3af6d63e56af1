"""Request checks that need more than the schema, and the request -> `SamplingParams` step.

Each failure is a 400 (404 for an unknown model) naming the parameter to change.
"""

from __future__ import annotations

from deploy.openai.schema import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from worker.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit


def check_common(req: CompletionRequest | ChatCompletionRequest, model_name: str) -> None:
    if req.model != model_name:
        raise APIError(
            404, f"The model '{req.model}' does not exist; this server serves "
            f"'{model_name}' (see GET /v1/models)", param="model", code="model_not_found",
        )  # fmt: skip
    if req.presence_penalty or req.frequency_penalty:
        name = "presence_penalty" if req.presence_penalty else "frequency_penalty"
        raise bad_request(f"{name} is not supported; send 0 or omit it", param=name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported; omit it", param="logit_bias")
    if len(req.stop_list()) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")


def check_completion(req: CompletionRequest, model_name: str) -> None:
    check_common(req, model_name)
    if req.echo:
        raise bad_request("echo is not supported; send false or omit it", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported; omit it", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (no server-side ranking)", param="best_of")


def check_chat(req: ChatCompletionRequest, model_name: str) -> None:
    check_common(req, model_name)
    if req.tools:
        raise bad_request("tools are not supported; omit them", param="tools")
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool_choice must be 'none' or omitted", param="tool_choice")
    if req.response_format and req.response_format.get("type") != "text":
        raise bad_request("response_format must be {'type': 'text'}", param="response_format")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    chat: bool,
    default_max_tokens: int,
) -> SamplingParams:
    """The engine's parameters for one prompt; the context limit is checked here (400, code
    `context_length_exceeded`) so the client learns which number to lower."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"prompt has {prompt_len} tokens; this model's context is {max_model_len} "
            f"tokens, so at most {max_model_len - 1} prompt tokens fit",
            param="messages" if chat else "prompt", code="context_length_exceeded",
        )  # fmt: skip
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens or room  # chat: up to the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    else:
        max_tokens = req.max_tokens or default_max_tokens
        logprobs, name = req.logprobs, "max_tokens"
    if max_tokens > room:
        raise bad_request(
            f"{name}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
            f"context of {max_model_len} tokens; ask for at most {room}",
            param=name, code="context_length_exceeded",
        )  # fmt: skip
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=tuple(req.stop_list()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
    try:
        params.validate()
    except ValueError as e:  # the message starts with the parameter's name
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
    return params

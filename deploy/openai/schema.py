"""OpenAI-compatible request/response models and the error shape (docs/design.md §4.2).

Requests are parsed strictly (`strict=True`, unknown fields rejected) so a typo such as
`"tempreature"` or `"max_tokens": "5"` is a 400 naming the field, never silently ignored.
Only the common no-op fields OpenAI clients send (`user`, `metadata`, `store`, …) are accepted
without effect. Responses are pydantic models serialised with `model_dump(exclude_none=True)`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# ----------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error answered in OpenAI's shape `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(status: int, message: str, retry_after_s: int) -> APIError:
    kind = "rate_limit_error" if status == 429 else "server_error"
    code = "rate_limit_exceeded" if status == 429 else "service_unavailable"
    return APIError(
        status, message, type=kind, code=code, headers={"Retry-After": str(retry_after_s)}
    )


def _param_of(loc: tuple[Any, ...]) -> str | None:
    # NOTE: pydantic puts union branch tags ("str", "list[int]", "TextPart") into `loc`;
    # the client only cares about the path of real field names / indices up to the first tag.
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"} or p[:1].isupper()):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def parse_request(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body into `model`; malformed JSON and bad fields become a 400 APIError."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"Request body is not valid JSON: {err['msg']}") from None
        param = _param_of(tuple(err["loc"]))
        where = f" (at '{param}')" if param else ""
        raise bad_request(f"Invalid request{where}: {err['msg']}", param=param) from None


# ----------------------------------------------------------------------------------------------
# Requests

_STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool = Field(False, description="Accepted; usage comes in the final chunk only.")


class _CommonRequest(BaseModel):
    model_config = _STRICT

    model: str = Field(description="Served model name (see /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    stream: bool = Field(False, description="Server-sent events instead of one JSON body.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = Field(None, description="Per-request sampling seed.")
    presence_penalty: float = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be empty.")
    # vLLM/SGLang-style extensions
    top_k: int | None = Field(None, description="Sample among the k most likely tokens (-1/0: off).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Minimum probability relative to the top token.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    # accepted, no effect
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, token ids, or a batch of either."
    )
    echo: bool = Field(False, description="Not supported; must be false.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Top-n logprobs per token.")
    suffix: str | None = Field(None, description="Not supported; must be null.")
    best_of: int | None = Field(None, description="Must equal n when set.")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Return per-token logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Top-n alternatives per token.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported; must be empty.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none' is supported.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'}.")
    parallel_tool_calls: bool | None = None


# ----------------------------------------------------------------------------------------------
# Responses


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swaserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

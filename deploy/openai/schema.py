"""OpenAI-compatible request models and the error shape (docs/design.md §4.2).

Requests are parsed strictly (`strict=True`, unknown fields rejected) so a typo such as
`"tempreature"` or `"max_tokens": "5"` is a 400 naming the field, never silently ignored.
Only the common no-op fields OpenAI clients send (`user`, `metadata`, `store`, …) are accepted
without effect. vLLM's extensions real clients send (`top_k`, `repetition_penalty`, `guided_json`,
…) are honoured. The response models are in `deploy.openai.bodies`.
"""

from __future__ import annotations

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
LOGPROBS_MAX = 20
CACHE_SALT_CHARS = 256  # a 256-bit salt is 43 base64 characters; hashed once per request


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool = Field(False, description="Accepted; usage comes in the final chunk only.")


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field("response", description="A name for the schema.")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"] = Field(description="Output format.")
    json_schema: JsonSchemaFormat | None = Field(None, description="Required with type json_schema.")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (the newer spelling of the guided_* fields)."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark grammar.")


class _CommonRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    model: str = Field(description="Served model name (see /v1/models).")
    max_tokens: int | None = Field(None, ge=0, description="Upper bound on generated tokens (0: prompt only).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    stream: bool = Field(False, description="Server-sent events instead of one JSON body.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Stop strings (any number).")
    seed: int | None = Field(None, description="Sampling seed (any integer).")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Penalty on tokens already generated.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Penalty per occurrence in the output.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    # vLLM/SGLang-style extensions
    top_k: int | None = Field(None, ge=-1, description="Sample among the k most likely tokens (-1/0: off).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Minimum probability relative to the top token.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM's repetition penalty (1: off).")
    min_tokens: int = Field(0, ge=0, description="No EOS or stop before this many tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string at the end of the text.")
    prompt_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="Logprobs of each prompt token.")
    guided_json: dict[str, Any] | str | None = Field(None, description="Output follows this JSON schema.")
    guided_regex: str | None = Field(None, description="Output matches this regular expression.")
    guided_choice: list[str] | None = Field(None, description="Output is exactly one of these strings.")
    guided_grammar: str | None = Field(None, description="Output follows this Lark grammar.")
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = Field(
        None, min_length=1, max_length=CACHE_SALT_CHARS,
        description="Requests with different salts never share cached KV (vLLM's): one secret, "
        "random salt per tenant keeps the prefix cache from telling one tenant another's prompts.",
    )  # fmt: skip
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
    echo: bool = Field(False, description="Return the prompt before the completion (and its logprobs).")
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="Top-n logprobs per token.")
    suffix: str | None = Field(None, description="Not supported; must be null.")
    best_of: int | None = Field(None, ge=1, le=16, description="Generate this many, return the n most likely.")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier tool calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    reasoning_content: str | None = Field(None, description="An assistant's earlier reasoning.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=0, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Return per-token logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="Top-n alternatives per token.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function."
    )
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (required mode).")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(None, description="GPT-OSS reasoning level.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra chat template variables.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn header.")
    continue_final_message: bool = Field(False, description="Continue the last (assistant) message.")

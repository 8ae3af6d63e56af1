"""Bad inputs and the answer each must get (status, error type, param, code), shared by the
in-process API tests and the end-to-end HTTP tests. `None` in an expectation means "not checked"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BadInput:
    name: str
    path: str
    body: bytes
    status: int
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    real_engine: bool = False  # refused by the real engine only (the fake one checks no grammar)


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def bad_inputs(model: str, max_model_len: int) -> list[BadInput]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    msgs = [{"role": "user", "content": "Hi"}]
    return [
        BadInput("malformed json", c, b'{"model": "x", "prompt": ', 400),
        BadInput("body is a list", c, b"[1, 2]", 400),
        BadInput("missing prompt", c, _j({"model": model}), 400, param="prompt"),
        BadInput("unknown model", c, _j({**ok, "model": "gpt-17"}), 404, param="model", code="model_not_found"),
        BadInput("negative temperature", c, _j({**ok, "temperature": -1}), 400, param="temperature"),
        BadInput("temperature not a number", c, _j({**ok, "temperature": "hot"}), 400, param="temperature"),
        BadInput("top_p zero", c, _j({**ok, "top_p": 0}), 400, param="top_p"),
        BadInput("top_k below -1", c, _j({**ok, "top_k": -5}), 400, param="top_k"),
        BadInput("max_tokens negative", c, _j({**ok, "max_tokens": -1}), 400, param="max_tokens"),
        BadInput("max_tokens as string", c, _j({**ok, "max_tokens": "5"}), 400, param="max_tokens"),
        BadInput("max_tokens beyond context", c, _j({**ok, "max_tokens": max_model_len + 10}), 400,
                 param="max_tokens", code="context_length_exceeded"),
        BadInput("empty prompt text", c, _j({**ok, "prompt": ""}), 400, param="prompt"),
        BadInput("empty token list", c, _j({**ok, "prompt": []}), 400, param="prompt"),
        BadInput("token id outside vocab", c, _j({**ok, "prompt": [10**9]}), 400, param="prompt"),
        BadInput("prompt longer than context", c, _j({**ok, "prompt": [5] * (max_model_len + 1)}), 400,
                 param="prompt", code="context_length_exceeded"),
        BadInput("unknown field", c, _j({**ok, "tempreature": 0.5}), 400, param="tempreature"),
        BadInput("n zero", c, _j({**ok, "n": 0}), 400, param="n"),
        BadInput("logprobs too many", c, _j({**ok, "logprobs": 21}), 400, param="logprobs"),
        BadInput("stop not strings", c, _j({**ok, "stop": ["a", 5]}), 400, param="stop"),
        BadInput("presence penalty out of range", c, _j({**ok, "presence_penalty": 2.5}), 400, param="presence_penalty"),
        BadInput("repetition penalty zero", c, _j({**ok, "repetition_penalty": 0}), 400, param="repetition_penalty"),
        BadInput("logit_bias key not a token id", c, _j({**ok, "logit_bias": {"hello": 1}}), 400, param="logit_bias"),
        BadInput("logit_bias value too big", c, _j({**ok, "logit_bias": {"5": 300}}), 400, param="logit_bias"),
        BadInput("min_tokens above max_tokens", c, _j({**ok, "min_tokens": 9}), 400, param="min_tokens"),
        BadInput("best_of below n", c, _j({**ok, "n": 3, "best_of": 2}), 400, param="best_of"),
        BadInput("best_of streamed", c, _j({**ok, "n": 1, "best_of": 2, "stream": True}), 400, param="best_of"),
        BadInput("suffix", c, _j({**ok, "suffix": "end"}), 400, param="suffix"),
        BadInput("prompt_logprobs too many", c, _j({**ok, "prompt_logprobs": 21}), 400, param="prompt_logprobs"),
        BadInput("json_schema without schema", c, _j({**ok, "response_format": {"type": "json_schema"}}), 400,
                 param="response_format.json_schema"),
        BadInput("two output constraints", c, _j({**ok, "guided_regex": "a+", "guided_choice": ["x"]}), 400,
                 param="guided_choice"),
        BadInput("guided_json not JSON", c, _j({**ok, "guided_json": "{nope"}), 400, param="guided_json"),
        BadInput("bad regex", c, _j({**ok, "guided_regex": "[a-"}), 400, param="grammar", real_engine=True),
        BadInput("stream_options without stream", c, _j({**ok, "stream_options": {"include_usage": True}}),
                 400, param="stream_options"),
        BadInput("chat without messages", ch, _j({"model": model, "messages": []}), 400, param="messages"),
        BadInput("chat bad role", ch, _j({"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
                 400, param="messages.0.role"),
        BadInput("chat tool without function", ch, _j({"model": model, "messages": msgs, "tools": [{"type": "function"}]}),
                 400, param="tools.0.function"),
        BadInput("chat image content", ch, _j({"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, param="messages.0.content"),
        BadInput("chat tool_choice without tools", ch, _j({"model": model, "messages": msgs, "tool_choice": "required"}),
                 400, param="tool_choice"),
        BadInput("chat unknown named tool", ch, _j({"model": model, "messages": msgs, "tools": [
            {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            400, param="tool_choice"),
        BadInput("chat continue without assistant", ch, _j({"model": model, "messages": msgs,
                 "continue_final_message": True, "add_generation_prompt": False}), 400, param="continue_final_message"),
        BadInput("chat unknown model", ch, _j({"model": "nope", "messages": msgs}), 404, param="model",
                 code="model_not_found"),
        # limits (deploy/openai/limits.py), each refused before the prompt is tokenized
        BadInput("too many stop strings", c, _j({**ok, "stop": [f"s{i}" for i in range(33)]}), 400, param="stop"),
        BadInput("stop string too long", c, _j({**ok, "stop": ["x" * 65]}), 400, param="stop"),
        BadInput("too many stop_token_ids", c, _j({**ok, "stop_token_ids": [1] * 1025}), 400, param="stop_token_ids"),
        BadInput("stop_token_id outside vocab", c, _j({**ok, "stop_token_ids": [10**9]}), 400, param="stop_token_ids"),
        BadInput("too many logit_bias entries", c, _j({**ok, "logit_bias": {str(i): 1 for i in range(1025)}}), 400,
                 param="logit_bias"),
        BadInput("logit_bias key a non-ASCII digit", c, _j({**ok, "logit_bias": {"\u00b2": 1}}), 400, param="logit_bias"),
        BadInput("logit_bias key of 5,000 digits", c, _j({**ok, "logit_bias": {"1" * 5000: 1}}), 400, param="logit_bias"),
        BadInput("logit_bias key outside vocab", c, _j({**ok, "logit_bias": {"1000000": 1}}), 400, param="logit_bias"),
        BadInput("prompt bytes beyond the context", c, _j({**ok, "prompt": "x" * (8 * max_model_len + 1)}), 400,
                 param="prompt", code="context_length_exceeded"),
        BadInput("guided_json nested 1,500 deep", c, _j({**ok, "guided_json": "[" * 1500 + "]" * 1500}), 400,
                 param="guided_json"),
        BadInput("self-referencing schema", c, _j({**ok, "guided_json": {"$defs": {"a": {"type": "object",
                 "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}, "$ref": "#/$defs/a"}}), 400,
                 param="grammar", real_engine=True),
        BadInput("empty cache_salt", c, _j({**ok, "cache_salt": ""}), 400, param="cache_salt"),
        BadInput("cache_salt too long", c, _j({**ok, "cache_salt": "s" * 257}), 400, param="cache_salt"),
        BadInput("chat cache_salt not a string", ch, _j({"model": model, "messages": msgs, "cache_salt": 7}), 400,
                 param="cache_salt"),
        BadInput("chat too many messages", ch, _j({"model": model, "messages": [{"role": "user"}] * 2049}), 400,
                 param="messages"),
        BadInput("chat too many tools", ch, _j({"model": model, "messages": msgs, "tools": [
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}), 400, param="tools"),
        BadInput("chat too many tool calls in a message", ch, _j({"model": model, "messages": [*msgs, {
            "role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * 129}]}), 400,
            param="messages.1.tool_calls"),
        BadInput("GET on a POST route", c, b"", 405, method="GET"),
        BadInput("unknown route", "/v1/engines", b"{}", 404),
    ]  # fmt: skip


def check_error(status: int, body: Any, case: BadInput) -> None:
    """Assert one answer matches `case` and has OpenAI's error shape."""
    assert status == case.status, (case.name, status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, (case.name, body)
    assert isinstance(err["message"], str) and err["message"], case.name
    assert err["type"] == case.type, (case.name, err)
    if case.param is not None:
        assert err["param"] == case.param, (case.name, err)
    if case.code is not None:
        assert err["code"] == case.code, (case.name, err)

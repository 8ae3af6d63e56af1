"""The non-generation routes clients probe: `/v1/models/{id}`, `/tokenize`, `/detokenize`
(vLLM's shapes: `{"model", "prompt" | "messages", "add_special_tokens"}` → `{"count",
"max_model_len", "tokens"}`, and `{"model", "tokens"}` → `{"prompt"}`). Their work (parsing,
the size checks, the chat template, tokenizing, decoding) runs on the service's pool, off the
event loop, within the same limits as a completion's prompt (`RequestChecks`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from deploy.openai.bodies import DetokenizeResponse, TokenizeResponse
from deploy.openai.checks import RequestChecks
from deploy.openai.prompts import PromptBuilder
from deploy.openai.schema import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    bad_request,
    parse_request,
)
from deploy.openai.service import OpenAIService

_STRICT = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize (or messages).")
    messages: list[ChatMessage] | None = Field(None, description="A chat, rendered by the chat template.")
    add_special_tokens: bool = Field(True, description="Add BOS etc. (text prompts).")
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int] = Field(description="Token ids to turn into text.")


def _check_model(name: str | None, model_name: str) -> None:
    if name is not None and name != model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")  # fmt: skip


def add_utility_routes(
    app: FastAPI, service: OpenAIService, model_name: str, read: Callable[[Request], Awaitable[bytes]]
) -> None:
    """`read(request)`: the body, with the ingress's size limit."""
    tok = service.tokenizer
    prompts = PromptBuilder(tok)
    checks = RequestChecks(model_name, len(tok), service.limits)

    def json(body: BaseModel) -> Response:
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    def tokenize_ids(raw: bytes, max_model_len: int) -> list[int]:
        req: TokenizeRequest = parse_request(TokenizeRequest, raw)
        _check_model(req.model, model_name)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest.model_validate(
                {"model": model_name, "messages": req.messages, "add_generation_prompt": req.add_generation_prompt}
            )
            checks.chat(chat, max_model_len)
            return prompts.chat(chat)
        assert req.prompt is not None
        checks.text(req.prompt, max_model_len)
        return list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])

    def detokenize_text(raw: bytes, max_model_len: int) -> str:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, raw)
        _check_model(req.model, model_name)
        if len(req.tokens) > max_model_len:
            raise bad_request(f"at most {max_model_len} tokens (the context); got {len(req.tokens)}",
                              param="tokens")  # fmt: skip
        vocab = len(tok)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return str(tok.decode(req.tokens))

    async def off_loop(fn: Callable[[bytes, int], Any], request: Request) -> Any:
        raw = await read(request)
        return await service.pool.run(fn, raw, await service.max_model_len())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return json(await service.model_card())

    @app.post("/tokenize", openapi_extra={"requestBody": {"content": {"application/json": {
        "schema": TokenizeRequest.model_json_schema()}}}})  # fmt: skip
    async def tokenize(request: Request) -> Response:
        ids = await off_loop(tokenize_ids, request)
        return json(TokenizeResponse(count=len(ids), max_model_len=await service.max_model_len(), tokens=ids))

    @app.post("/detokenize", openapi_extra={"requestBody": {"content": {"application/json": {
        "schema": DetokenizeRequest.model_json_schema()}}}})  # fmt: skip
    async def detokenize(request: Request) -> Response:
        return json(DetokenizeResponse(prompt=await off_loop(detokenize_text, request)))


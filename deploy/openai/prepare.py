"""A generation request's body -> its parsed request, prompt token ids and grammar.

All of it is per-request CPU in the size of what the client sent (parsing the JSON, the checks,
the chat template, tokenizing, reading a schema), so the service runs it on its pool
(`deploy/openai/offload.py`), off the event loop, unless the body is a few KB at most
(`offload.SMALL_BODY`: cheaper in place than the hop to a thread). The checks come first: a request over a
limit is refused before its prompt is tokenized or templated (`RequestChecks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.sampling_params import Grammar
from deploy.openai.chat_format import ChatFormat
from deploy.openai.checks import RequestChecks
from deploy.openai.limits import RequestLimits
from deploy.openai.prompts import PromptBuilder
from deploy.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_request,
)
from deploy.openai.structured import request_grammar


@dataclass(frozen=True)
class Prepared:
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]  # token ids, one list per prompt
    grammar: Grammar | None


class Preparer:
    def __init__(self, checks: RequestChecks, prompts: PromptBuilder, chat: ChatFormat, limits: RequestLimits) -> None:
        self._checks, self._prompts, self._chat, self._limits = checks, prompts, chat, limits

    def completion(self, raw: bytes, max_model_len: int) -> Prepared:
        req: CompletionRequest = parse_request(CompletionRequest, raw)
        self._checks.completion(req, max_model_len)  # before tokenizing
        return Prepared(req, self._prompts.completion(req.prompt), request_grammar(req, self._limits))

    def chat(self, raw: bytes, max_model_len: int) -> Prepared:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
        self._checks.chat(req, max_model_len)  # before templating
        prompts = [self._chat.prompt(req)]
        grammar, forced = request_grammar(req, self._limits), self._chat.grammar(req)
        if grammar is not None and forced is not None:
            raise bad_request("tool_choice required/named cannot be combined with an output format",
                              param="tool_choice")  # fmt: skip
        return Prepared(req, prompts, grammar or forced)

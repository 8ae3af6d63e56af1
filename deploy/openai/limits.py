"""How much one request may ask for (docs/design.md §4.2, README "Limits"), and the bounded JSON
parse for text the ingress did not write.

Every limit bounds work the ingress or a worker does per request, per token or per step on
threads other requests share; past one, the request is a 400 naming the field. vLLM and SGLang
bound none of these counts; where a client ecosystem has a number (OpenAI's 128 tools) it is the
default here. The values live in one frozen `RequestLimits` so a deployment can change them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic_core


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may hold; each bounds a cost the request does not pay alone."""

    stop: int = 32  # stop strings: each is searched after every token, worker and ingress
    stop_chars: int = 64  # characters per stop string: the worker decodes that many tokens per token
    stop_token_ids: int = 1_024  # a set lookup per token, a ban per step until min_tokens
    logit_bias: int = 1_024  # entries scattered into the logits every step
    tools: int = 128  # OpenAI's limit; also the tool calls of one message
    messages: int = 2_048  # each one a pass of the chat template on the event loop
    message_bytes: int = 1 << 20  # UTF-8 bytes of one message (content, calls, reasoning)
    grammar_bytes: int = 256 << 10  # a schema / regex / Lark grammar / choices, compiled per choice
    # A prompt's UTF-8 bytes per token of context it could fill. Text averages 3-5 bytes per
    # token (CJK ~3, code and English ~4); 8 leaves room for long merges (runs of spaces or
    # symbols), so this only refuses, before tokenizing, text that cannot fit.
    bytes_per_token: int = 8

    def prompt_bytes(self, max_model_len: int) -> int:
        """The most UTF-8 bytes a prompt (all of a chat's messages) may have."""
        return max_model_len * self.bytes_per_token


def parse_json(text: str) -> Any:
    """JSON text the ingress did not write (a schema sent as a string, a client's tool-call
    arguments, the model's tool calls) as Python values; ValueError when it is malformed or
    nests deeper than about 200 levels.

    NOTE: `json.loads` recurses once per nesting level and raises RecursionError near 1,000 (an
    answer of 500, or a parser that dies on the model's output). pydantic-core's parser, the one
    request bodies go through, does not recurse and stops at its depth limit."""
    return pydantic_core.from_json(text)

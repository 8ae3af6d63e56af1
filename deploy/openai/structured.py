"""Structured-output fields of a request → one `Grammar` for the worker (docs/design.md §4.2).

Spellings accepted: OpenAI's `response_format` (json_object, json_schema), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark) and their newer `structured_outputs`
object. At most one may be given (a 400 names the second), of at most `grammar_bytes`
(`RequestLimits`). Whether the grammar itself is valid is the worker's grammar engine's call; its
refusal comes back as a 400 naming `grammar`.
"""

from __future__ import annotations

import json
from typing import Any

from core.sampling_params import Grammar
from deploy.openai.limits import RequestLimits, parse_json
from deploy.openai.schema import ChatCompletionRequest, CompletionRequest, bad_request

ANY_OBJECT = '{"type": "object"}'


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = parse_json(schema)
        except ValueError as e:  # malformed, or nested deeper than the parser allows
            raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema)


def _from_response_format(req: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_schema", ANY_OBJECT)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request(
            "response_format json_schema needs json_schema.schema", param="response_format.json_schema"
        )
    return Grammar("json_schema", _schema_text(fmt.json_schema.schema_, "response_format.json_schema.schema"))


def request_grammar(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits) -> Grammar | None:
    """The request's output constraint, or None. Raises a 400 when two are given, or one larger
    than `limits.grammar_bytes`."""
    so = req.structured_outputs
    found: list[tuple[str, Grammar]] = []

    def add(param: str, grammar: Grammar | None) -> None:
        if grammar is not None:
            found.append((param, grammar))

    add("response_format", _from_response_format(req))
    if req.guided_json is not None:
        add("guided_json", Grammar("json_schema", _schema_text(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        add("guided_regex", Grammar("regex", req.guided_regex))
    if req.guided_choice is not None:
        add("guided_choice", Grammar("choice", choices=tuple(req.guided_choice)))
    if req.guided_grammar is not None:
        add("guided_grammar", Grammar("lark", req.guided_grammar))
    if so is not None:
        if so.json_ is not None:
            add("structured_outputs.json", Grammar("json_schema", _schema_text(so.json_, "structured_outputs.json")))
        if so.regex is not None:
            add("structured_outputs.regex", Grammar("regex", so.regex))
        if so.choice is not None:
            add("structured_outputs.choice", Grammar("choice", choices=tuple(so.choice)))
        if so.grammar is not None:
            add("structured_outputs.grammar", Grammar("lark", so.grammar))
    if len(found) > 1:
        raise bad_request(
            f"{found[1][0]} conflicts with {found[0][0]}: give one output constraint", param=found[1][0]
        )
    if not found:
        return None
    param, grammar = found[0]
    if grammar.kind == "choice" and not all(grammar.choices):
        raise bad_request(f"{param} needs non-empty strings", param=param)
    size = _size(grammar)
    if size > limits.grammar_bytes:
        raise bad_request(f"{param} is {size:,} bytes; grammars may have at most {limits.grammar_bytes:,}",
                          param=param)  # fmt: skip
    return grammar


def _size(g: Grammar) -> int:
    """UTF-8 bytes the grammar engine compiles (a choice: its strings, one separator each)."""
    return len(g.text.encode()) + sum(len(c.encode()) + 1 for c in g.choices)

"""Tool calling for chat models that use their chat template (docs/design.md §4.2).

`tool_choice`:

| value | prompt | output |
|---|---|---|
| `none` | tools rendered by the template | plain content, never parsed |
| `auto` (default with tools) | tools rendered | the model's own call format, parsed (`HermesParser`, `MistralParser`) |
| `required` | tools rendered | constrained by a grammar to a JSON list of `{"name", "parameters"}` (`ForcedParser`) |
| named | tools rendered | constrained to that function's parameters schema (`ForcedParser`) |

Forced calls use the grammar engine (as vLLM does), so they hold whatever the model is; `auto`
depends on the model emitting its format. GPT-OSS uses harmony instead (`deploy.openai.harmony`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from core.sampling_params import Grammar
from deploy.openai.bodies import FunctionCallOut, ToolCallDelta, ToolCallOut
from deploy.openai.limits import parse_json
from deploy.openai.schema import ChatCompletionRequest, NamedToolChoice, Tool, bad_request


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def effective_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    return req.tool_choice


def check_tools(req: ChatCompletionRequest) -> None:
    choice = req.tool_choice
    if choice in ("required", "auto") and not req.tools:
        raise bad_request(f"tool_choice '{choice}' needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools or []]
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names '{choice.function.name}', which is not among tools {names}",
                param="tool_choice",
            )


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_grammar(req: ChatCompletionRequest) -> Grammar | None:
    """The grammar forcing a call (required / named), or None."""
    choice, tools = effective_choice(req), req.tools or []
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return Grammar("json_schema", json.dumps(_parameters(tool)))
    if choice != "required":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return Grammar("json_schema", json.dumps(schema))


@dataclass
class ChatPiece:
    """What one delta adds to a chat choice."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatParser:
    """Plain content (and the base of the others): `feed` each text delta, then `finish`."""

    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCallOut] = []

    def feed(self, text: str, token_ids: list[int]) -> ChatPiece:
        self.content += text
        return ChatPiece(content=text)

    def finish(self) -> ChatPiece:
        return ChatPiece()

    def _call(self, name: str, arguments: Any) -> ToolCallDelta:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        out = ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=args))
        self.calls.append(out)
        return ToolCallDelta(index=len(self.calls) - 1, id=out.id, type="function", function=out.function)


class TaggedCallParser(ChatParser):
    """Calls between an open and a close marker, as JSON `{"name", "arguments"}` (Hermes, Qwen,
    MiMo: `<tool_call>…</tool_call>`), or a JSON list after one marker (Mistral:
    `[TOOL_CALLS][…]`). Text that could still become a marker is held back."""

    def __init__(self, open_tag: str, close_tag: str | None) -> None:
        super().__init__()
        self.open_tag, self.close_tag = open_tag, close_tag
        self._buf = ""
        self._in_call = False

    def feed(self, text: str, token_ids: list[int]) -> ChatPiece:
        self._buf += text
        piece = ChatPiece()
        while True:
            if not self._in_call:
                at = self._buf.find(self.open_tag)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.open_tag)
                    piece.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                piece.content += self._buf[:at]
                self._buf, self._in_call = self._buf[at + len(self.open_tag) :], True
            elif self.close_tag is not None and self.close_tag in self._buf:
                body, self._buf = self._buf.split(self.close_tag, 1)
                piece.tool_calls += self._parse(body, piece)
                self._in_call = False
            else:
                break
        self.content += piece.content
        return piece

    def finish(self) -> ChatPiece:
        piece = ChatPiece()
        if self._in_call:
            piece.tool_calls = self._parse(self._buf, piece)
        else:
            piece.content = self._buf
        self._buf, self._in_call = "", False
        self.content += piece.content
        return piece

    def _parse(self, body: str, piece: ChatPiece) -> list[ToolCallDelta]:
        try:
            value = parse_json(body.strip())
        except ValueError:  # not JSON, or nested too deep to be a call
            value = None
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in items):
            piece.content += self.open_tag + body + (self.close_tag or "")  # not a call after all
            return []
        return [self._call(v["name"], v.get("arguments", v.get("parameters", {}))) for v in items]


class ForcedParser(ChatParser):
    """tool_choice required (a JSON list of calls) or named (the arguments): all of the output is
    the call, so it is parsed when the choice ends."""

    def __init__(self, named: str | None) -> None:
        super().__init__()
        self.named = named
        self._text = ""

    def feed(self, text: str, token_ids: list[int]) -> ChatPiece:
        self._text += text
        return ChatPiece()

    def finish(self) -> ChatPiece:
        if self.named is not None:
            return ChatPiece(tool_calls=[self._call(self.named, self._text)])
        try:
            calls = parse_json(self._text)
        except ValueError:  # cut by max_tokens (or nested too deep): nothing parses
            self.content = self._text
            return ChatPiece(content=self._text)
        return ChatPiece(tool_calls=[self._call(c["name"], c["parameters"]) for c in calls])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


TOOL_FORMATS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", None)}
FORMAT_BY_MODEL_TYPE = {"mistral": "mistral"}  # everything else: hermes


def chat_parser(req: ChatCompletionRequest, model_type: str) -> ChatParser:
    choice = effective_choice(req)
    if isinstance(choice, NamedToolChoice):
        return ForcedParser(choice.function.name)
    if choice == "required":
        return ForcedParser(None)
    if choice == "auto":
        open_tag, close_tag = TOOL_FORMATS[FORMAT_BY_MODEL_TYPE.get(model_type, "hermes")]
        return TaggedCallParser(open_tag, close_tag)
    return ChatParser()

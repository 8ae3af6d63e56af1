"""Tool-call parsers for template models: Hermes/Qwen tags and Mistral's marker, streamed in any
split; text that only looks like a call stays content; the forced (grammar) forms."""

from __future__ import annotations

import json

import pytest

from deploy.openai.tools import ForcedParser, TaggedCallParser

HERMES = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _feed(parser: TaggedCallParser | ForcedParser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for i in range(0, len(text), step):
        piece = parser.feed(text[i : i + step], [])
        content += piece.content
        calls += [(c.function.name, c.function.arguments) for c in piece.tool_calls]
    tail = parser.finish()
    calls += [(c.function.name, c.function.arguments) for c in tail.tool_calls]
    return content + tail.content, calls  # type: ignore[misc]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_calls_in_any_split(step: int) -> None:
    """Content before the tag streams; the call comes out whole with JSON arguments."""
    content, calls = _feed(TaggedCallParser("<tool_call>", "</tool_call>"), HERMES, step)
    assert content == "Let me check."
    assert calls == [("get_weather", json.dumps({"city": "Oslo"}))]


def test_not_a_call_stays_content_and_partial_tags_flush() -> None:
    """A tag around non-JSON is content; a trailing '<tool' prefix is content at the end."""
    text = "<tool_call>not json</tool_call> and <tool"
    content, calls = _feed(TaggedCallParser("<tool_call>", "</tool_call>"), text, 2)
    assert calls == [] and content == text


def test_mistral_marker_with_a_list() -> None:
    """[TOOL_CALLS] followed by a JSON list of calls, parsed when the output ends."""
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    content, calls = _feed(TaggedCallParser("[TOOL_CALLS]", None), text, 5)
    assert content == "" and [c[0] for c in calls] == ["a", "b"]


def test_forced_named_and_required() -> None:
    """Named: the whole output is the arguments; required: a list of {name, parameters}."""
    _, named = _feed(ForcedParser("f"), '{"x": 1}', 3)
    assert named == [("f", '{"x": 1}')]
    _, required = _feed(ForcedParser(None), '[{"name": "g", "parameters": {"y": 2}}]', 4)
    assert required == [("g", json.dumps({"y": 2}))]


def test_model_output_nested_too_deep_is_content_not_a_crash() -> None:
    """A tool call (or a forced call list) nested 5,000 deep in the model's output is not parsed
    with a recursion that blows the stack: it stays content."""
    deep = "[" * 5000 + "]" * 5000
    content, calls = _feed(TaggedCallParser("<tool_call>", "</tool_call>"), f"<tool_call>{deep}</tool_call>", 1000)
    assert calls == [] and content == f"<tool_call>{deep}</tool_call>"
    content, calls = _feed(ForcedParser(None), deep, 1000)
    assert calls == [] and content == deep

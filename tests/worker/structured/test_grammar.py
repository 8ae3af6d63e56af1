"""Structured outputs on the built-in tiny model: JSON schema, regex, choice and Lark grammars
constrain sampled text; invalid grammars are refused up front naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from core.sampling_params import Grammar, SamplingParams
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.models.model_dir import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(model="tiny", max_total_tokens=4096))


def _texts(engine: Engine, grammar: Grammar, seeds: range, max_tokens: int = 64) -> list[str]:
    tok = load_tokenizer(engine.parts.model_dir)  # type: ignore[arg-type]
    prompt = tok("Describe a person:")["input_ids"]
    params = [SamplingParams(max_tokens=max_tokens, seed=s, grammar=grammar) for s in seeds]
    outs = engine.generate([prompt] * len(params), params)
    assert all(o.finish_reason == "stop" for o in outs), [o.finish_reason for o in outs]
    return [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]


def test_json_schema_output_validates(engine: Engine) -> None:
    """Sampled (temperature 1) outputs parse as JSON and satisfy the schema, for 8 seeds."""
    import jsonschema

    for text in _texts(engine, Grammar("json_schema", json.dumps(SCHEMA)), range(8)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_and_lark(engine: Engine) -> None:
    """Regex outputs match it fully; choice outputs are one of the choices; Lark too."""
    assert all(re.fullmatch(r"[a-c]{2,4}-\d", t) for t in _texts(engine, Grammar("regex", r"[a-c]{2,4}-\d"), range(4)))
    assert {*_texts(engine, Grammar("choice", choices=("yes", "no")), range(6))} <= {"yes", "no"}
    assert {*_texts(engine, Grammar("lark", 'start: "up" | "down"'), range(4))} <= {"up", "down"}


@pytest.mark.parametrize("grammar", [Grammar("json_schema", "{"), Grammar("regex", "[a-"), Grammar("choice")])
def test_invalid_grammar_is_refused_naming_it(engine: Engine, grammar: Grammar) -> None:
    """A malformed grammar raises ValueError starting with 'grammar' before anything is queued."""
    with pytest.raises(ValueError, match=r"^grammar"):
        engine.add_request([5, 6, 7], SamplingParams(grammar=grammar))
    assert not engine.has_work()


def test_refused_token_error_carries_no_parser_internals(engine: Engine) -> None:
    """A token the grammar refuses fails the matcher with a one-line reason: no parser state or
    grammar text (llguidance's verbose errors) reaches a client."""
    tok = load_tokenizer(engine.parts.model_dir)  # type: ignore[arg-type]
    m = engine.grammars.compile(Grammar("regex", "[0-9]{3}-[a-c]"))
    m.accept(tok("ew")["input_ids"][-1])
    assert m.failed.startswith("Parser Error") and "<" not in m.failed and "\n" not in m.failed


def test_a_matcher_out_of_step_with_the_output_denies_its_row(engine: Engine) -> None:
    """The mask row of a matcher that has not consumed exactly the request's output allows
    nothing (the sampler then reports the row unsampled); an in-step row is the grammar's."""
    from worker.structured.masks import MaskFiller

    grammar = Grammar("choice", choices=("yes", "no"))
    fresh, behind = engine.grammars.compile(grammar), engine.grammars.compile(grammar)
    filler = MaskFiller(engine.spec.vocab_size)
    future = filler.start([(fresh, 0), (None, 3), (behind, 1)])
    assert future is not None
    bitmask = future.result()
    filler.close()
    assert int(bitmask[0].count_nonzero()) > 0 and int(bitmask[2].count_nonzero()) == 0


SELF_REFERENCE = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
                  "$ref": "#/$defs/a"}  # fmt: skip


def test_a_grammar_llguidance_gives_up_on_is_refused_up_front(engine: Engine) -> None:
    """A schema whose every output must open itself forever ({"x": {"x": ...) exhausts
    llguidance's budget while its forced prefix is walked at add time: a ValueError naming the
    grammar, not a request failing in its first steps."""
    with pytest.raises(ValueError, match=r"^grammar \(json_schema\) is invalid: .*Too many items"):
        engine.add_request([5, 6, 7], SamplingParams(grammar=Grammar("json_schema", json.dumps(SELF_REFERENCE))))
    assert not engine.has_work()


def test_a_deeply_nested_schema_is_refused_not_a_recursion_error(engine: Engine) -> None:
    """A schema text nested 5,000 deep is a ValueError naming the grammar (json.loads would
    recurse until RecursionError)."""
    deep = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    with pytest.raises(ValueError, match=r"^grammar json_schema is invalid"):
        engine.add_request([5, 6, 7], SamplingParams(grammar=Grammar("json_schema", deep)))
    assert not engine.has_work()


def test_parser_limits_are_set_explicitly() -> None:
    """Every llguidance limit is chosen here, not inherited from its defaults."""
    from llguidance import LLParserLimits

    from worker.structured.grammar import PARSER_LIMITS

    fields = {name for name in dir(LLParserLimits) if not name.startswith("_")}
    assert fields == set(PARSER_LIMITS)

"""A request's grammar: `Grammar` (core.sampling_params) → llguidance matcher (docs/design.md §4.1).

`GrammarCompiler` owns the llguidance tokenizer (built once from the model's HF tokenizer, sized
to the model's vocabulary so masks cover every logit) and turns a `Grammar` into a
`GrammarMatcher`: the per-request parser state the scheduler advances with each accepted token
and the mask filler reads. Invalid grammars raise ValueError naming the parameter, when the
request is validated, never inside a step; so does one llguidance gives up on (`compile` walks
its forced prefix). llguidance is imported on first use: engines that never see a grammar never
load it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.sampling_params import Grammar

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    from worker.models.model_dir import Tokenizer


# JSON as `json.dumps` writes it (no free whitespace: a model cannot pad forever); keywords the
# compiler does not implement are ignored rather than refused (a schema's "x-guidance" overrides).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

# llguidance's resource limits, set here rather than inherited (its defaults in comments). Masks
# are filled while the forward runs and the step waits for them, so the per-step budgets bound
# what one request's grammar can add to every request's step; compile-time budgets bound the work
# of validating a request (off the step thread). Speeds are llguidance's own figures.
PARSER_LIMITS = {
    "max_items_in_row": 2_000,  # (2,000) Earley items of one grammar row: ambiguity blow-up
    "initial_lexer_fuel": 1_000_000,  # (1M) building the lexer at compile: ~20 ms at ~50k/ms
    "step_lexer_fuel": 100_000,  # (200k) one mask's lexer work: ~7 ms at ~14k/ms
    "step_max_items": 20_000,  # (50k) one mask's Earley items: ~1 ms at ~20k/ms
    "max_lexer_states": 20_000,  # (250k) lexer states, built lazily, 1-2 kB each: <= ~40 MB
    "max_grammar_size": 200_000,  # (500k) symbols after expansion; requests' grammars are <= 256 KiB
    "precompute_large_lexemes": True,  # (True) big regexes run over the token trie at compile,
    # off the step thread, so masks are cheaper in the steps
    "verbose_errors": False,  # no parser state or grammar text in messages a client sees
}


class GrammarMatcher:
    """One request's parser state (step thread only, after creation)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0  # tokens accepted: a mask is computed only when it equals the output's
        self.failed = ""  # set when a token was refused (the request then ends with an error)

    def accept(self, token: int) -> None:
        self.consumed += 1
        if not self.failed and not self.matcher.consume_token(token):
            self.failed = short_error(self.matcher.get_error()) or f"the grammar refused token {token}"

    @property
    def done(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self.matcher.is_stopped()


def short_error(message: str) -> str:
    """llguidance's error without its tags (matchers are built with `verbose_errors` off, so
    no parser state or grammar text reaches a client)."""
    return message.split("\n<", 1)[0].strip()


def grammar_source(g: Grammar) -> str:
    """llguidance's grammar text for `g` (ValueError naming the field when `g` is malformed)."""
    from llguidance import LLMatcher

    if g.kind == "json_schema":
        if not g.text.lstrip().startswith("{"):
            raise ValueError("grammar json_schema must be a JSON object")
        # NOTE: the text goes to llguidance as is: its parser stops at 128 levels, where
        # json.loads would recurse until RecursionError.
        try:
            return LLMatcher.grammar_from_json_schema(g.text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"grammar json_schema is invalid: {short_error(str(e))}") from None
    if g.kind == "regex":
        return LLMatcher.grammar_from_regex(g.text)
    if g.kind == "choice":
        if not g.choices or not all(isinstance(c, str) and c for c in g.choices):
            raise ValueError("grammar choice needs at least one non-empty string")
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in g.choices))
    return LLMatcher.grammar_from_lark(g.text)


class GrammarCompiler:
    """Compiles grammars against one tokenizer; thread-safe (callers compile off the step thread)."""

    def __init__(self, tokenizer_loader: Callable[[], Tokenizer] | None, vocab_size: int) -> None:
        self._loader = tokenizer_loader
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self._loader is None:
                    raise ValueError("grammar needs the model's tokenizer, which this engine lacks")
                try:
                    import llguidance.hf
                except ImportError:
                    raise ValueError(
                        "grammar needs the llguidance package; install swaserve's dependencies"
                    ) from None
                hf = self._loader()
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)  # type: ignore[arg-type]
            return self._tokenizer

    def compile(self, g: Grammar) -> GrammarMatcher:
        """A fresh matcher for `g`. Raises ValueError (starting with "grammar") when invalid, or
        when llguidance gives up on it within `PARSER_LIMITS`."""
        from llguidance import LLMatcher

        tokenizer = self._ll_tokenizer()
        source = grammar_source(g)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=_limits())
        if is_error:
            raise ValueError(f"grammar ({g.kind}) is invalid: {short_error(messages[0])}")
        matcher = LLMatcher(tokenizer, source, log_level=0, limits=_limits())
        error = matcher.get_error() if matcher.is_error() else _forced_prefix_error(matcher)
        if error:
            raise ValueError(f"grammar ({g.kind}) is invalid: {short_error(error)}")
        return GrammarMatcher(matcher)


def _limits() -> LLParserLimits:
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)  # type: ignore[arg-type]


def _forced_prefix_error(matcher: LLMatcher) -> str:
    """llguidance's error on consuming, on a copy, the tokens every output must start with ("":
    none). A grammar whose forced prefix never ends (a required property whose schema is its
    own, `{"x": {"x": ...`) exhausts llguidance's budget here, refused with the request, not in
    its first steps after it was accepted."""
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced and not probe.is_error():
        probe.consume_tokens(forced)
    return probe.get_error() if probe.is_error() else ""

"""`SamplingParams`: how one request picks its tokens and when it stops (docs/design.md §4.1)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from core.events import salted_root

MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one logit_bias value: [-100, 100]

GrammarKind = Literal["json_schema", "regex", "choice", "lark"]


@dataclass(frozen=True)
class Grammar:
    """A structured-output constraint, compiled by the worker's grammar engine.

    ``json_schema``: `text` is a JSON schema (``{"type": "object"}`` for any JSON object);
    ``regex``: a regular expression the whole output matches; ``choice``: one of `choices`
    exactly; ``lark``: a Lark grammar (llguidance's dialect).
    """

    kind: GrammarKind
    text: str = ""
    choices: tuple[str, ...] = ()


def _as_tuple(value: object, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping):
        return tuple(value.items())
    if isinstance(value, Sequence):
        return tuple(value)
    raise ValueError(f"{name} must be a list, got {type(value).__name__}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 and ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` (any integer) makes a request's samples reproducible
    regardless of what else is in the batch. ``logprobs=n`` returns the chosen token's logprob
    plus the top n (n = 0: the chosen token's only); None returns none. ``prompt_logprobs=n``
    does the same for every prompt token after the first (the prefix cache is not used for
    such a request). ``stop`` strings and ``stop_token_ids`` end the request; the EOS token does
    too unless ``ignore_eos``; none of them before ``min_tokens`` tokens. ``max_tokens == 0``
    computes the prompt only (for prompt logprobs).

    Logit controls (docs/design.md §4.1), applied in this order before temperature:
    ``logit_bias`` ((token id, bias) pairs), ``presence_penalty`` / ``frequency_penalty``
    (OpenAI's, over the generated tokens), ``repetition_penalty`` (vLLM's, over prompt and
    generated tokens: positive logits divided by it, negative ones multiplied), then the
    ``grammar`` mask.

    ``cache_salt`` (vLLM's): requests with different salts never share cached KV, on a worker
    or in the router's index (docs/design.md §9.10); one salt per tenant isolates tenants. Kept
    out of the repr: it is a tenant's secret.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    grammar: Grammar | None = None
    cache_salt: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Normalise list inputs (the HTTP layer passes lists) so the dataclass stays hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _as_tuple(self.logit_bias, "logit_bias"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # What the step thread reads of a request every step, derived once. NOTE: cached_property
    # writes the instance's __dict__ directly (the dataclass is frozen); the values are not
    # fields, so equality, hashing and `dataclasses.replace` never see them.

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

    @cached_property
    def root_hash(self) -> int:
        """Where the request's page-hash chain starts, and which root of a worker's tree it
        uses: ROOT_HASH without a salt (`core.events.salted_root`)."""
        return salted_root(self.cache_salt)

    @cached_property
    def longest_stop(self) -> int:
        """Characters in the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)

    def banned_until_min_tokens(self, eos: frozenset[int]) -> frozenset[int]:
        """EOS and the stop token ids, which may not be sampled before `min_tokens`. Built once
        per `eos` object (an engine's never changes), so every step gets the same set."""
        cached = self.__dict__.get("_banned")
        if cached is None or cached[0] is not eos:
            cached = self.__dict__["_banned"] = (eos, eos | self.stop_token_set)
        return cached[1]

    @property
    def penalized(self) -> bool:
        """Any penalty that reads the tokens seen so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the offending parameter and its allowed range."""
        for ok, message in self._checks():
            if not ok:
                raise ValueError(f"{message}; got {self._value_of(message)!r}")

    def _checks(self) -> list[tuple[bool, str]]:
        def logprob_count(n: object) -> bool:
            return n is None or (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS)

        return [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens must be an integer >= 0"),
            (_number(self.temperature) and self.temperature >= 0.0, "temperature must be >= 0 (0 = greedy)"),
            (_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1 or 0 (off) or >= 1"),
            (_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             "seed must be an integer or null"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must hold non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must hold token ids >= 0"),
            (logprob_count(self.logprobs), f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}]"),
            (logprob_count(self.prompt_logprobs),
             f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}]"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= max(self.max_tokens, 0),
             "min_tokens must be an integer in [0, max_tokens]"),
            (_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be in [-2, 2]"),
            (_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be in [-2, 2]"),
            (_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
             "repetition_penalty must be > 0 (1 = off)"),
            (all(isinstance(t, int) and t >= 0 and _number(b) and abs(b) <= MAX_LOGIT_BIAS
                 for t, b in self.logit_bias),
             f"logit_bias must map token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (self.grammar is None or isinstance(self.grammar, Grammar), "grammar must be a Grammar"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             "cache_salt must be a non-empty string or null"),
        ]  # fmt: skip

    def _value_of(self, message: str) -> object:
        return getattr(self, message.split(" ", 1)[0])

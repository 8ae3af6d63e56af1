"""`SamplingParams`: how one request picks its tokens and when it stops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs


def _as_tuple(value: object, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence):
        return tuple(value)
    raise ValueError(f"{name} must be a list, got {type(value).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 and ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` makes a request's samples reproducible regardless of what
    else is in the batch. ``logprobs=n`` returns the chosen token's logprob plus the top n
    (n = 0: the chosen token's only); None returns none. ``stop`` strings and
    ``stop_token_ids`` end the request; the EOS token does too unless ``ignore_eos``.
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

    def __post_init__(self) -> None:
        # Normalise list inputs (the HTTP layer passes lists) so the dataclass stays hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending parameter and its allowed range."""
        checks: list[tuple[bool, str]] = [
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens must be an integer >= 1",
            ),
            (self.temperature >= 0.0, "temperature must be >= 0 (0 = greedy)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (
                isinstance(self.top_k, int) and self.top_k >= -1,
                "top_k must be -1 or 0 (off) or >= 1",
            ),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer or null"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must hold non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must hold token ids >= 0",
            ),
            (
                self.logprobs is None
                or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}; got {self._value_of(message)!r}")

    def _value_of(self, message: str) -> object:
        return getattr(self, message.split(" ", 1)[0])

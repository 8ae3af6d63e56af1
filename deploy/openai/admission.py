"""Admission by work at one ingress replica: the sequences and tokens a request will hold.

A request is prompts × choices sequences (`n`, or `best_of` when larger), and holds each
prompt's tokens once (its choices share the prefill) plus `max_tokens` for every choice. One
HTTP request may be one sequence or 256 (16 prompts × best_of 16), so counting HTTP requests
bounds nothing; these two numbers bound what the workers are asked to hold through this ingress.

| request | answer |
|---|---|
| fits in what is left of both bounds | admitted; its `Ticket` gives it back when the request ends |
| fits the bounds but not what is left now | 429 + `Retry-After` (`rate_limit_exceeded`) |
| larger than a bound on its own | 400 naming the field to lower (it could never be admitted) |
| arrives while the sequences are all taken | 429 before its prompt is tokenized (`check_room`) |

Full workers (Serve's queues, a worker refusing `unavailable`) are 503 + `Retry-After`
(`deploy/openai/streaming.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.metrics import IngressMetrics
from deploy.openai.schema import bad_request, overloaded


@dataclass(frozen=True)
class AdmissionLimits:
    """What one ingress replica holds in flight (`ServeConfig.max_inflight_*`)."""

    sequences: int = 1024
    tokens: int = 8_388_608


@dataclass(frozen=True)
class Work:
    """What one request will hold: its sequences and tokens, and the field each grows with."""

    sequences: int
    tokens: int
    sequences_param: str = "n"
    tokens_param: str = "max_tokens"


class Ticket:
    """One admitted request's share; `release` gives it back (idempotent)."""

    def __init__(self, admission: Admission, work: Work) -> None:
        self._admission, self.work = admission, work
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back(self.work)


class Admission:
    def __init__(self, limits: AdmissionLimits, retry_after_s: int, metrics: IngressMetrics) -> None:
        self.limits = limits
        self._retry_after_s = retry_after_s
        self._metrics = metrics
        self.sequences = 0
        self.tokens = 0
        self.requests = 0

    def check_room(self) -> None:
        """429 at once when no sequence is left (before the request's prompt is tokenized)."""
        if self.sequences >= self.limits.sequences:
            raise self._busy(f"{self.sequences:,} sequences in flight (max_inflight_sequences="
                             f"{self.limits.sequences:,})")  # fmt: skip

    def admit(self, work: Work) -> Ticket:
        """Take `work`'s share or refuse: 400 when it is over a bound alone, else 429 when it
        is over what is left."""
        lim = self.limits
        if work.sequences > lim.sequences:
            raise bad_request(f"this request is {work.sequences:,} sequences (prompts x choices); "
                              f"at most {lim.sequences:,} run at once here (max_inflight_sequences)",
                              param=work.sequences_param)  # fmt: skip
        if work.tokens > lim.tokens:
            raise bad_request(f"this request may hold {work.tokens:,} tokens (each prompt once plus "
                              f"max_tokens per choice); at most {lim.tokens:,} are held at once here "
                              "(max_inflight_tokens)", param=work.tokens_param)  # fmt: skip
        if self.sequences + work.sequences > lim.sequences:
            raise self._busy(f"{self.sequences:,} of {lim.sequences:,} sequences in flight and "
                             f"this request needs {work.sequences:,}")  # fmt: skip
        if self.tokens + work.tokens > lim.tokens:
            raise self._busy(f"{self.tokens:,} of {lim.tokens:,} tokens in flight and this "
                             f"request may hold {work.tokens:,}")  # fmt: skip
        self.sequences += work.sequences
        self.tokens += work.tokens
        self.requests += 1
        self._metrics.in_flight.set(self.requests)
        return Ticket(self, work)

    def _give_back(self, work: Work) -> None:
        self.sequences -= work.sequences
        self.tokens -= work.tokens
        self.requests -= 1
        self._metrics.in_flight.set(self.requests)

    def _busy(self, what: str) -> Exception:
        return overloaded(429, f"server busy: {what}; retry later", self._retry_after_s)

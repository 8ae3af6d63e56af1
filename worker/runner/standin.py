"""Compute-free runners: the real engine (scheduler, cache, stops) around a step that computes no
model, for benchmarks of everything but the model.

`ComputeFreeRunner` has `Runner`'s interface (`worker/runner/base.py`) with no weights, no KV and
no logits: `forward` counts the step's prefill and decode tokens and hands back logits with no
vocabulary (the row count is all sampling needs); subclasses pick the tokens. The routing
simulator's `SimRunner` (bench/sim_runner.py) is one: every row samples one constant token and a
virtual clock prices the step.

`StandInRunner` is the serving ceiling's (`EngineConfig.standin_tokens_per_s`, benchmarks only):
the served engine process runs it in place of the model, so the HTTP path, the router, the worker
replica and the engine's own host work are all that is left to measure.

- Pace: a step takes max(its own CPU, 1 / `tokens_per_s`): the next forward waits for the
  deadline one period after the previous one began (a timed wait, never busy work), so each
  running request gets `tokens_per_s` tokens a second until the host work alone takes longer.
- Tokens: drawn from `vocab` (the real vocabulary less EOS and special ids, so the real
  detokenizer has real text to do) by a counter-based hash of the request's noise key and its
  step: deterministic per request, different between requests. A row's `banned` ids (stop ids
  before `min_tokens`) are skipped. `max_tokens` and stop strings are the engine's, as always.
- NOTE: no logprobs exist here. A request asking for them gets 0.0 for the chosen token (and
  it alone as its top-n); prompt logprobs end the request with an error saying so. Grammar masks
  are not applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.sampler import SampleOutput, SampleRow

_MASK64 = (1 << 64) - 1
NO_PROMPT_LOGPROBS = "the stand-in runner (standin_tokens_per_s) computes no prompt logprobs"


class ComputeFreeRunner:
    """`forward` counts the step's tokens and returns logits with no vocabulary; `pick` (the
    subclass's) chooses each row's token.

    A row feeding one token after a non-empty prefix counts as a decode (a one-token prefill
    rest after a cache hit is priced the same way: one token either way).
    """

    def __init__(self) -> None:
        self.last_prefill_tokens = 0
        self.last_decode_tokens = 0
        self.fed_tokens = 0  # every token fed since start (prefill and decode)
        self.repair_tokens = 0  # of those, repair rows (docs/design.md §9.8; priced as prefill)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        prefill = decode = 0
        for r in batch.reqs:
            n = len(r.token_ids)
            if n == 1 and r.prefix_len > 0 and r.repair is None:
                decode += 1
            else:
                prefill += n
            self.repair_tokens += r.repair_tokens
        self.last_prefill_tokens, self.last_decode_tokens = prefill, decode
        self.fed_tokens += prefill + decode
        return ForwardOutput(torch.empty(batch.num_logits, 0), prompt_errors=self.prompt_errors(batch))

    def prompt_errors(self, batch: ForwardBatch) -> dict[int, str]:
        """Batch index -> why its prompt logprobs did not come (none: they are not asked for)."""
        return {}

    def pick(self, row: SampleRow) -> int:
        raise NotImplementedError

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        n = len(rows)
        assert n == logits.shape[0], f"{n} sampling rows for {logits.shape[0]} logits rows"
        tokens = [self.pick(r) for r in rows]
        logprobs: list[float | None] = [None if r.params.logprobs is None else 0.0 for r in rows]
        top = [None if r.params.logprobs is None else [(t, 0.0)][: r.params.logprobs]
               for r, t in zip(rows, tokens)]  # fmt: skip
        return SampleOutput(tokens, logprobs, top)


def mix64(key: int, step: int) -> int:
    """A 64-bit hash of (key, step) (splitmix64's finaliser over their sum): the draw counter."""
    z = (key * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def plain_vocabulary(vocab_size: int, excluded: Sequence[int]) -> tuple[int, ...]:
    """The ids a stand-in may emit: every id of the vocabulary but `excluded` (EOS, specials)."""
    drop = set(excluded)
    ids = tuple(i for i in range(vocab_size) if i not in drop)
    if not ids:
        raise ValueError(f"no token left to emit: all {vocab_size} ids are EOS or special")
    return ids


class StandInRunner(ComputeFreeRunner):
    """Tokens from `vocab` at `tokens_per_s` steps a second at most (the module docstring).

    `clock` and `wait` are the pacing's (tests pass a fake clock; the engine the real ones)."""

    def __init__(
        self,
        vocab: Sequence[int],
        tokens_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
        self.vocab = tuple(vocab)
        self.period_s = 1.0 / tokens_per_s
        self._clock, self._wait = clock, wait
        self._due = float("-inf")  # the earliest start of the next step

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        now = self._clock()
        if now < self._due:
            self._wait(self._due - now)
            now = self._due
        self._due = now + self.period_s
        return super().forward(batch)

    def prompt_errors(self, batch: ForwardBatch) -> dict[int, str]:
        return {i: NO_PROMPT_LOGPROBS for i, r in enumerate(batch.reqs) if r.prompt_logprobs is not None}

    def pick(self, row: SampleRow) -> int:
        n = len(self.vocab)
        i = mix64(row.key, row.step) % n
        for _ in range(n):  # `banned` is a few stop ids at most: this ends at once
            token = self.vocab[i]
            if token not in row.banned:
                return token
            i = (i + 1) % n
        return self.vocab[i]  # every id banned: nothing better to give

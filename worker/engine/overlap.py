"""Overlap scheduling (docs/design.md §11.8): step N+1 is scheduled and its host inputs built
while step N's forward runs, and step N's tokens are processed one step late.

    step thread:    schedule N+1 │ prepare N+1 │ submit N+1 │ process N (wait for it) │ ...
    forward thread:   ... forward + sample N │ forward + sample N+1 ...

Steps run on one forward thread, strictly in order, so KV a step writes is there before any
later step reads it, and a slot freed on the step thread is reused only by a later step. A
decode of step N+1 whose input is the token step N is still sampling feeds a *future token
id*: ``-1 - i`` for row i of step N's samples, replaced on the forward thread just before the
forward (SGLang keeps such placeholders in a ring on the device; with one step in flight the
ring is simply the previous step's sampled tokens). Host inputs are fresh tensors per step:
the step thread never writes what the forward thread reads.

Off (`overlap_schedule: off`, or a runner that cannot split its host half from its device
half, e.g. tensor parallelism): the same `Launched` step is run inline and processed at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from worker.runner.base import Runner
from worker.runner.forward_batch import ForwardBatch, ForwardOutput, ForwardReq
from worker.runner.sampler import SampleOutput, SampleRow
from worker.scheduler.plan import StepWork
from worker.scheduler.request import Req

if TYPE_CHECKING:
    from worker.runner.model_runner import ModelRunner, PreparedStep


@dataclass(frozen=True)
class StepResult:
    forward: ForwardOutput  # the sampling rows' logits and the prompt logprobs
    sampled: SampleOutput
    tokens: torch.Tensor  # int64 [samplers]: what the next step's future token ids name


@dataclass(frozen=True)
class Launched:
    """A step handed to the forward thread, its results not yet processed."""

    work: list[StepWork]
    fwd: tuple[ForwardReq, ...]
    samplers: list[StepWork]  # the work items that sample, in row order
    prompt_only: list[Req]  # requests whose prompt ends in this step with nothing to sample
    result: Future[StepResult]
    rows: dict[Req, int]  # sampler -> its row in `result.tokens`
    needs_history: bool  # a sampler's next row needs this token first (grammar, penalties)
    overlapped: bool  # on the forward thread (else done: processed within its own step)


def forward_reqs(work: Sequence[StepWork], previous: Launched | None) -> tuple[ForwardReq, ...]:
    """The step's `ForwardReq`s; a decode whose input is still being sampled feeds its future
    token id."""
    out = []
    for w in work:
        f = w.forward_req()
        if w.decode and w.req.pending:
            assert previous is not None, f"request {w.req.rid} has a token in flight but no step is"
            f = replace(f, token_ids=[-1 - previous.rows[w.req]])
        out.append(f)
    return tuple(out)


def sample_index(fwd: Sequence[ForwardReq], samples: Sequence[bool]) -> list[int]:
    """Per sampling request, the logits row it samples from (its last)."""
    rows, offset = [], 0
    for f, s in zip(fwd, samples):
        offset += f.logit_rows
        if s:
            rows.append(offset - 1)
    return rows


class Forwarder:
    """Runs steps: on its own thread when overlapping (a `ModelRunner`, which splits its host
    half from its device half), else inline on the step thread."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None

    def submit(
        self,
        runner: Runner,
        batch: ForwardBatch,
        index: list[int],
        rows: list[SampleRow],
        masks: Future[torch.Tensor] | None,
        previous: Future[StepResult] | None,
        before: Callable[[], None] | None = None,
    ) -> tuple[Future[StepResult], bool]:
        """The step's result, and whether it runs on the forward thread (else it is done).
        `before` runs just before the forward, on the thread that runs it (the step's KV
        copies between tiers, docs/design.md §9.9)."""
        from worker.runner.model_runner import ModelRunner  # (the engine imports no model code)

        if not (self.overlap and isinstance(runner, ModelRunner)):
            if before is not None:
                before()
            done: Future[StepResult] = Future()
            done.set_result(self._sample(runner, runner.forward(batch), index, rows, masks))
            return done, False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "swaserve-forward")
        step = runner.prepare(batch)  # the host half, here on the step thread
        return self._pool.submit(self._run, runner, step, index, rows, masks, previous, before), True

    def _run(
        self,
        runner: ModelRunner,
        step: PreparedStep,
        index: list[int],
        rows: list[SampleRow],
        masks: Future[torch.Tensor] | None,
        previous: Future[StepResult] | None,
        before: Callable[[], None] | None,
    ) -> StepResult:
        future = previous.result().tokens if previous is not None else None  # done: one thread
        if before is not None:
            before()
        return self._sample(runner, runner.run_prepared(step, future), index, rows, masks)

    def _sample(
        self,
        runner: Runner,
        forward: ForwardOutput,
        index: list[int],
        rows: list[SampleRow],
        masks: Future[torch.Tensor] | None,
    ) -> StepResult:
        logits = forward.logits
        picked = logits.index_select(0, torch.tensor(index, dtype=torch.int64, device=logits.device))
        sampled = runner.sample(picked, rows, masks.result() if masks else None)
        return StepResult(forward, sampled, torch.tensor(sampled.token_ids, dtype=torch.int64))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

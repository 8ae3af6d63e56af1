"""`Runner`: what the engine needs of a model runner, one step at a time. `ModelRunner` is the
real one; tensor parallelism's `TPRunner` (`worker/parallel/runner.py`), the routing simulator's
compute-free `SimRunner` and the serving ceiling's `StandInRunner` (`worker/runner/standin.py`)
stand in for it (`tests/fakes/conformance.py` checks all four)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.sampler import SampleOutput, SampleRow


class Runner(Protocol):
    """Runs one step. The engine allocates the slots; the runner writes KV and computes."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Logits ``[batch.num_logits, vocab]`` (float32), in batch order, and the prompt
        logprobs asked for (forward_batch.py)."""
        ...

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """One token per logits row, for the requests whose rows are given, in order; `bitmask`
        (int32 ``[len(rows), ceil(vocab / 32)]``) holds the grammar's allowed tokens for rows
        marked `masked`."""
        ...

"""The typed seams of the engine: what it needs of a model runner, and what a serving replica
needs of an engine. Implementations are checked against them by the type checker
(`tests/test_typing.py` runs mypy on the packages and on `tests/fakes`).

    WorkerDeployment ──EngineClient──▶ AsyncEngine (tests: FakeEngine)
    Engine ──────────────Runner──────▶ ModelRunner (bench: SimRunner)
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from worker.cache.events import CacheEvent, PageState
from worker.config import EngineConfig
from worker.outputs import EngineStats, StreamDelta
from worker.runner.forward_batch import ForwardBatch
from worker.runner.sampler import SampleOutput
from worker.sampling_params import SamplingParams


class Runner(Protocol):
    """Runs one step. The engine allocates the slots; the runner writes KV and computes."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch.num_logits, vocab]`` (float32), in batch order (forward_batch.py)."""
        ...

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SampleOutput:
        """One token per logits row, for the requests whose params are given, in order."""
        ...


class EngineClient(Protocol):
    """What a worker replica drives: an engine stepped on its own thread, streaming to asyncio.

    Every method may be called from the replica's event loop thread; state reads are snapshots.
    """

    @property
    def config(self) -> EngineConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_dir(self) -> Path | None: ...

    @property
    def window(self) -> int | None:
        """Keys to the left when the model has SWA layers, else None."""
        ...

    @property
    def swa_layers(self) -> int:
        """How many layers slide (the repair rule's n_swa, docs/design.md §9.8)."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Set when the step thread died; the replica then reports unhealthy."""
        ...

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (the message says what to change) for a request that can never run."""
        ...

    def generate(
        self, token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream the request's deltas; closing the iterator early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """The snapshot the step thread published after its last step."""
        ...

    def check_integrity(self) -> None: ...

    def flush_cache(self) -> bool: ...

    def drain_and_snapshot(self) -> tuple[list[CacheEvent], dict[int, PageState]]:
        """Pending cache events and the snapshot they lead to, taken atomically."""
        ...

    def drain_cache_events(self) -> list[CacheEvent]: ...

    def shutdown(self) -> None: ...

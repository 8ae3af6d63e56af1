"""The typed seams of the engine: what it needs of a model runner, and what a serving replica
needs of an engine. Implementations are checked against them by the type checker
(`tests/test_typing.py` runs mypy on the packages and on `tests/fakes`).

    WorkerDeployment ──EngineClient──▶ EngineProcess, AsyncEngine (tests: FakeEngine)
    Engine ──────────────Runner──────▶ ModelRunner (bench: SimRunner; TP: TPRunner)
    build_engine_parts ──RankLauncher─▶ ProcessLauncher (deploy: Ray rank actors) → Ranks
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from core.events import CacheEvent, PageState
from core.outputs import EngineStats, StreamDelta
from core.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.parallel.group import TPAddress
from worker.runner.forward_batch import ForwardBatch
from worker.runner.sampler import SampleOutput, SampleRow


class Runner(Protocol):
    """Runs one step. The engine allocates the slots; the runner writes KV and computes."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch.num_logits, vocab]`` (float32), in batch order (forward_batch.py)."""
        ...

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """One token per logits row, for the requests whose rows are given, in order; `bitmask`
        (int32 ``[len(rows), ceil(vocab / 32)]``) holds the grammar's allowed tokens for rows
        marked `masked`."""
        ...


class Ranks(Protocol):
    """Ranks 1..N-1 of a tensor-parallel engine, as rank 0 sees them (docs/design.md §17.4)."""

    def failure(self) -> str | None:
        """Why a rank is gone (exited, died, unreachable), or None while all of them run. Cheap:
        called on every request and health check."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to exit (after the stop message), then end them."""
        ...


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 of an engine, each running `worker.engine.tp_setup.run_rank`."""

    def rendezvous_host(self) -> str:
        """The address the ranks reach rank 0 at (loopback when they share its host)."""
        ...

    def start(self, config: EngineConfig, address: TPAddress) -> Ranks:
        """Start them and return at once; they join rank 0's store at `address`."""
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
        """Set when the step thread died or a tensor-parallel rank is gone; the replica then
        reports unhealthy and refuses requests."""
        ...

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (the message says what to change) for a request that can never run."""
        ...

    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        follows: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream the request's deltas; closing the iterator early aborts it. `follows`: the id
        of an earlier choice of the same prompt; this one starts once that prompt is cached."""
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

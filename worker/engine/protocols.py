"""`EngineClient`: what a serving replica needs of an engine, the seam between the step loop and
its hosts (`worker/hosts/`). The engine's other seams sit below it, with the parts it is built
from: `Runner` (`worker/runner/base.py`) and `RankLauncher`/`Ranks` (`worker/assembly/ranks.py`).
The type checker holds every implementation to its protocol (`tests/test_typing.py` runs mypy on
the packages and on `tests/fakes`).

    WorkerDeployment ──EngineClient──▶ EngineProcess, AsyncEngine (tests: FakeEngine)
    Engine ──────────────Runner──────▶ ModelRunner (bench: SimRunner; TP: TPRunner)
    build_engine_parts ──RankLauncher─▶ ProcessLauncher (deploy: Ray rank actors) → Ranks
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from core.events import CacheEvent, PageState
from core.outputs import EngineStats, StreamDelta
from core.reuse import TierCosts
from core.sampling_params import SamplingParams
from worker.config import EngineConfig


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
    def tier_costs(self) -> TierCosts | None:
        """What the host tier charges per token (core/reuse.py); None without a host tier."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Set when the step thread died or a tensor-parallel rank is gone; the replica then
        reports unhealthy and refuses requests."""
        ...

    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        follows: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream the request's deltas; closing the iterator early aborts it. `follows`: the id
        of an earlier choice of the same prompt; this one starts once that prompt is cached. A
        request that can never run raises ValueError (the message says what to change) at the
        first step, before any delta: the add is the check."""
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


@runtime_checkable
class Divertible(Protocol):
    """An engine host whose running streams can hand their unfinished deltas to a callback as
    they arrive, instead of waking the stream's reader for each (`StreamingHost.divert`): the
    worker replica's delta channel takes them straight to its outbox."""

    def divert(self, request_id: str, to: Callable[[StreamDelta], bool]) -> bool: ...


@runtime_checkable
class DrainsAtOnce(Protocol):
    """An engine host whose pending cache events are already in this process (each step message
    carries its own): its `drain_cache_events` never waits for the step in flight (the marker:
    `drain_cache_events_now`, the same method), so the worker's event pump drains on its loop,
    with no thread hop per flush."""

    def drain_cache_events_now(self) -> list[CacheEvent]: ...

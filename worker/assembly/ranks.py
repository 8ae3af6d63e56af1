"""Ranks 1..N-1 of a tensor-parallel engine as rank 0 sees them (docs/design.md §17.4): who starts
them (`RankLauncher`: local processes, `worker/assembly/rank_processes.py`, or Ray actors,
`deploy/replica/ranks.py`; each rank runs `worker.assembly.rank.run_rank`), and `TensorParallel`,
what the engine keeps of them once built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from worker.config import EngineConfig
from worker.parallel.group import TPAddress
from worker.parallel.runner import TPRunner

STOP_TIMEOUT_S = 30.0  # ranks get this long to exit after the stop message


class Ranks(Protocol):
    """The started ranks."""

    def failure(self) -> str | None:
        """Why a rank is gone (exited, died, unreachable), or None while all of them run. Cheap:
        called on every request and health check."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to exit (after the stop message), then end them."""
        ...


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 of an engine, each running `worker.assembly.rank.run_rank`."""

    def rendezvous_host(self) -> str:
        """The address the ranks reach rank 0 at (loopback when they share its host)."""
        ...

    def start(self, config: EngineConfig, address: TPAddress) -> Ranks:
        """Start them and return at once; they join rank 0's store at `address`."""
        ...


@dataclass
class TensorParallel:
    """What the engine needs of its other ranks: are they alive, do their pools agree, stop."""

    runner: TPRunner
    ranks: Ranks

    def failure(self) -> str | None:
        return self.ranks.failure()

    def check_pools(self) -> None:
        self.runner.check_pools()

    def close(self, force: bool = False) -> None:
        stopped = not force and self.runner.stop()
        self.ranks.stop(STOP_TIMEOUT_S if stopped else 0.0)
        if not force:
            self.runner.close()

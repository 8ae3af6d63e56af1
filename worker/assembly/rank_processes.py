"""`ProcessLauncher`: ranks 1..N-1 of a tensor-parallel engine as local processes (offline
`Engine(EngineConfig(tensor_parallel_size=N))`, tests). Ray replicas use rank actors instead
(`deploy/replica/ranks.py`); both run `worker.assembly.rank.run_rank`.

The processes come from a fork server that imported the engine once, so a rank starts in well
under a second after the first; they are daemons (they end with the engine's process), and a rank
whose peer died raises out of its next collective and exits (docs/design.md §17.4).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.process import BaseProcess

import torch

from worker.assembly.rank import run_rank
from worker.config import EngineConfig
from worker.parallel.group import LOOPBACK, TPAddress

_PRELOAD = ["worker.assembly.rank", "transformers.models.auto.configuration_auto"]


class ProcessRanks:
    def __init__(self, procs: list[BaseProcess]) -> None:
        self.procs = procs  # index i: rank i + 1

    def failure(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)


class ProcessLauncher:
    """Ranks as child processes of this one, each with as many torch threads as the caller."""

    def rendezvous_host(self) -> str:
        return LOOPBACK

    def start(self, config: EngineConfig, address: TPAddress) -> ProcessRanks:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        threads = torch.get_num_threads()
        procs: list[BaseProcess] = []
        for rank in range(1, config.tensor_parallel_size):
            p = ctx.Process(
                target=run_rank,
                args=(config, rank, address, threads),
                name=f"swaserve-tp-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        return ProcessRanks(procs)

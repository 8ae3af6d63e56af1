"""Tensor-parallel ranks of a worker replica as Ray actors in the replica's placement group
(docs/design.md §17.4), the way vLLM's Ray executor places its workers.

Serve reserves the group (`ServeConfig.placement_group_bundles`: bundle 0 holds the replica,
bundle r the actor of rank r) and captures the replica's child actors into it; each rank actor
takes exactly its bundle's resources. The actors are the replica's children: Ray ends them when
the replica dies, and a rank that dies resolves its `run` call at once, which `failure()` (on
every request and health check) reports, so Serve replaces the replica instead of waiting on it.
"""

from __future__ import annotations

from typing import cast

import ray
from ray.actor import ActorHandle
from ray.util import get_current_placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker.assembly.rank import run_rank
from worker.config import EngineConfig
from worker.parallel.group import LOOPBACK, TPAddress

_STRICT = "STRICT_PACK"


class RankActor:
    """One rank; `run` returns only when rank 0 sends the stop message (or raises)."""

    def run(self, config: EngineConfig, rank: int, address: TPAddress, threads: int) -> None:
        run_rank(config, rank, address, threads)


class RayRanks:
    def __init__(self, actors: list[ActorHandle], runs: list[ray.ObjectRef]) -> None:
        self.actors, self.runs = actors, runs  # index i: rank i + 1

    def failure(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.runs.index(done[0]) + 1
        try:
            ray.get(done[0], timeout=0)
            why = "its loop ended"
        except Exception as e:  # noqa: BLE001 - the reason is the message
            why = f"{type(e).__name__}: {str(e)[:300]}"
        return f"tensor-parallel rank {rank} is gone ({why})"

    def stop(self, timeout_s: float) -> None:
        if timeout_s > 0:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


RANK_ACTOR_PREFIX = "swaserve-tp"


class RayRankLauncher:
    """Starts ranks 1..N-1 in bundles 1..N-1 of the calling replica's placement group, named
    ``swaserve-tp-<replica id>-rank<r>`` (operators and tests find them by name)."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id

    def rendezvous_host(self) -> str:
        pg = get_current_placement_group()
        strategy = placement_group_table(pg).get("strategy") if pg is not None else _STRICT
        # STRICT_PACK: every rank on this node; otherwise they reach rank 0 over the network.
        return LOOPBACK if strategy == _STRICT else ray.util.get_node_ip_address()

    def start(self, config: EngineConfig, address: TPAddress) -> RayRanks:
        pg = get_current_placement_group()
        n = config.tensor_parallel_size
        if pg is None or len(pg.bundle_specs) < n:
            raise RuntimeError(
                f"tensor_parallel_size={n} needs a placement group of {n} bundles around the "
                "replica (ServeConfig sets placement_group_bundles; a YAML Worker entry must keep "
                "them)"
            )
        actors: list[ActorHandle] = []
        runs: list[ray.ObjectRef] = []
        for rank in range(1, n):
            spec = pg.bundle_specs[rank]
            created = (
                ray.remote(RankActor)
                .options(
                    name=f"{RANK_ACTOR_PREFIX}-{self.replica_id}-rank{rank}",
                    num_cpus=spec.get("CPU", 0),
                    num_gpus=spec.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank
                    ),
                )
                .remote()
            )
            actor = cast(ActorHandle, created)  # Ray's stubs type .remote() of a class as a union
            actors.append(actor)
            threads = max(1, int(spec.get("CPU", 1)))  # torch threads: the bundle's whole CPUs
            runs.append(actor.run.remote(config, rank, address, threads))
        return RayRanks(actors, runs)

"""The routing simulator and the deployed worker report the same load signal for one engine."""

from __future__ import annotations

import asyncio
import dataclasses

from bench.routing.sim import SimCluster, Simulation
from bench.routing.workloads import WorkloadSize, make_workload
from cluster.messages import WorkerLoad
from core.outputs import EngineStats
from core.sampling_params import SamplingParams
from deploy.replica.deployment import WorkerDeployment, WorkerOptions
from worker.engine.engine import Engine


class _HeldEngine:
    """The simulator's engine as a worker deployment holds one (stats, shutdown)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def shutdown(self) -> None:
        pass  # the simulator owns the engine


def _busy_simulation() -> Simulation:
    """One simulated worker with a decoding, a prefilling (chunked) and a waiting request."""
    cluster = SimCluster(
        workers=1, full_tokens=4096, chunked_prefill_size=64, max_running_requests=2
    )
    workload = make_workload("multi_turn", WorkloadSize(workers=1, requests_per_worker=1))
    sim = Simulation(cluster, "round_robin", workload)
    engine = sim.workers["w000"].engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(2, 22)), params, "decoding")
    engine.add_request(list(range(100, 400)), params, "prefilling")
    engine.add_request(list(range(500, 600)), params, "waiting")
    for _ in range(2):
        engine.step()
    return sim


def test_simulator_and_worker_deployment_report_identical_routing_stats() -> None:
    """Same engine state: the simulator's stats tick and `record_routing_stats()` agree on every
    routing key, with work queued for prefill and requests decoding."""
    sim = _busy_simulation()
    worker = sim.workers["w000"]
    sim._tick(12.5, None)  # the simulator's own sampling path
    simulated = worker.load
    deployment = WorkerDeployment(
        sim.cluster.engine_config(),
        WorkerOptions(publish_events=False),
        engine_factory=lambda _: _HeldEngine(worker.engine),
        replica_id="w000",
    )
    deployed = WorkerLoad.from_routing_stats(asyncio.run(deployment.record_routing_stats()))
    assert simulated is not None and deployed is not None
    assert dataclasses.replace(deployed, timestamp_s=simulated.timestamp_s) == simulated
    assert simulated.queue_len == 1
    assert simulated.queued_prefill_tokens > 0 and simulated.running_decodes == 1

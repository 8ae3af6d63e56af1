"""Every policy's decision latency in the routing bench's simulated fleet:
`python -m bench.routing.policy_latency [--workers 8 32 64] [--policies ...]`.

Times every `RouterCore.decide` of the simulated latency run of `swaserve bench routing` (the
`multi_tenant` workload, 1–2K-token prompts, `--requests-per-worker` per worker, the index fed
by the engines' own cache events, pending pages and load corrections as deployed) per policy and
fleet size: wall-clock p50 / p99, the same in this thread's CPU time (what other processes' time
slices on a shared machine do not inflate), and the wall-clock p99 of the decisions no garbage
collection ran inside (a collection walks the whole process's heap, here the engines').

The collector runs as in an ingress replica, where the router decides (`deploy/replica/heap.py`:
what was built before the run frozen, first-generation collections every 20,000 allocations);
`--default-gc` keeps CPython's defaults instead.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.machine import load_average
from bench.routing.runs import LATENCY_WORKLOAD, RoutingSettings, cluster_for
from bench.routing.sim import Simulation
from bench.routing.workloads import WorkloadSize, make_workload
from deploy.replica.heap import settle_heap
from router.core import RouterCore
from router.policies import POLICY_NAMES


@dataclass(frozen=True)
class PolicyLatency:
    policy: str
    workers: int
    decisions: int
    wall_us: tuple[float, float]  # p50, p99
    cpu_us: tuple[float, float]
    with_gc: int  # decisions a garbage collection ran inside
    no_gc_p99_us: float  # wall-clock p99 of the others


def measure_policies(
    policies: Sequence[str], workers: int, requests_per_worker: int = 5, settled: bool = True
) -> list[PolicyLatency]:
    """The simulated latency run of `swaserve bench routing`, every decision timed; with
    `settled`, under an ingress replica's collector settings."""
    import torch

    torch.set_num_threads(1)  # as `bench.routing.runs.run_job`
    s = RoutingSettings()
    out = []
    for policy in policies:
        size = WorkloadSize(workers, requests_per_worker, s.load, s.seed)
        sim = Simulation(cluster_for(s, "swa_pressure", workers), policy, make_workload(LATENCY_WORKLOAD, size))
        samples = _time_decisions(sim.core, sim.run, settled)
        wall = sorted(w for w, _, _ in samples)
        cpu = sorted(c for _, c, _ in samples)
        quiet = sorted(w for w, _, gc_ran in samples if not gc_ran) or [0.0]
        out.append(PolicyLatency(policy, workers, len(samples), _p50_p99(wall), _p50_p99(cpu),
                                 sum(g for _, _, g in samples), _p50_p99(quiet)[1]))  # fmt: skip
    return out


def _time_decisions(
    core: RouterCore, run: Callable[[], object], settled: bool = False
) -> list[tuple[float, float, bool]]:
    """Run with `core.decide` timed: (wall µs, CPU µs, a collection ran inside) per decision;
    with `settled`, what exists before the run is frozen and the thresholds are an ingress
    replica's (both undone after)."""
    collections = [0]

    def count(phase: str, _: dict[str, int]) -> None:
        collections[0] += phase == "start"

    decide = core.decide
    samples: list[tuple[float, float, bool]] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        before, t0, c0 = collections[0], time.perf_counter(), time.thread_time()
        decision = decide(*args, **kwargs)
        samples.append(((time.perf_counter() - t0) * 1e6, (time.thread_time() - c0) * 1e6, collections[0] > before))
        return decision

    core.decide = timed  # type: ignore[method-assign]
    thresholds = gc.get_threshold()
    if settled:
        settle_heap()
    gc.callbacks.append(count)
    try:
        run()
    finally:
        gc.callbacks.remove(count)
        del core.decide
        if settled:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
    return samples


def _p50_p99(ordered: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(ordered, n=100) if len(ordered) > 1 else ordered * 99
    return qs[49], qs[98]


def policy_table(rows: Sequence[PolicyLatency]) -> str:
    lines = ["| policy | workers | decisions | wall p50 / p99 µs | CPU p50 / p99 µs | with a GC inside | p99 without µs |",
             "| --- | ---: | ---: | --- | --- | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.policy} | {r.workers} | {r.decisions} | {r.wall_us[0]:.0f} / {r.wall_us[1]:.0f} | "
                     f"{r.cpu_us[0]:.0f} / {r.cpu_us[1]:.0f} | {r.with_gc} | {r.no_gc_p99_us:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--policies", nargs="+", default=list(POLICY_NAMES))
    ap.add_argument("--requests-per-worker", type=int, default=5)
    ap.add_argument("--default-gc", action="store_true", help="CPython's collector settings, not an ingress replica's")
    args = ap.parse_args()
    load = load_average()
    rows = [r for w in args.workers
            for r in measure_policies(args.policies, w, args.requests_per_worker, not args.default_gc)]  # fmt: skip
    print(policy_table(rows))
    print(f"1-minute load average {load:.2f} before, {load_average():.2f} after")


if __name__ == "__main__":
    main()

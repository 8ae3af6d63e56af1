"""One `swaserve bench routing` run: its settings, the simulation jobs (in this process or in
`--jobs` spawned ones), the model presets, `--real`, and the result the report takes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from bench.harness import progress
from bench.machine import MachineInfo, load_average, machine_info
from bench.routing.figures import RunFigures, summarize
from bench.routing.sim import SimCluster, simulate
from bench.routing.stacks import PRESETS, StackRun, StackSettings, plan_stack_jobs, run_stack_job
from bench.routing.workloads import WORKLOADS, WorkloadSize, make_workload
from bench.sim_runner import StepCost
from router.policies import POLICY_NAMES

if TYPE_CHECKING:
    from bench.decision_latency import LatencyReport
    from bench.routing.real import RealResult

T = TypeVar("T")

POOLS = ("swa_pressure", "roomy_swa", "single_pool")
LATENCY_WORKLOAD = "multi_tenant"


@dataclass(frozen=True)
class RoutingSettings:
    workers: int = 16
    requests_per_worker: int = 20
    load: float = 0.6  # of the cluster's no-cache capacity (workloads.arrival_rate)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    pools: tuple[str, ...] = POOLS
    policies: tuple[str, ...] = POLICY_NAMES
    swa_ratio: float = 0.25  # the swa_pressure pool
    full_tokens: int = 16_384  # per worker
    page_size: int = 16
    window: int = 128
    latency_workers: int = 64
    latency_requests_per_worker: int = 5
    seed: int = 0
    jobs: int = 1  # simulations in parallel processes
    real: bool = False
    models: tuple[str, ...] = tuple(PRESETS)  # model presets of the stack comparison; () skips it
    stack_requests_per_worker: int = 250

    def __post_init__(self) -> None:
        for name in ("workers", "requests_per_worker", "latency_requests_per_worker", "jobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.latency_workers < 0:
            raise ValueError("--latency-workers must be >= 0 (0 skips the latency runs)")
        if not 0 < self.load:
            raise ValueError("--load must be > 0")
        _check_names("workload", self.workloads, WORKLOADS)
        _check_names("pool", self.pools, POOLS)
        _check_names("policy", self.policies, POLICY_NAMES)
        self.stack_settings()  # validates the preset part

    def stack_settings(self) -> StackSettings:
        return StackSettings(models=self.models, requests_per_worker=self.stack_requests_per_worker,
                             load=self.load, page_size=self.page_size, seed=self.seed)  # fmt: skip


def _check_names(kind: str, given: tuple[str, ...], known: object) -> None:
    bad = [g for g in given if g not in known]  # type: ignore[operator]
    if bad or not given:
        raise ValueError(f"unknown or no {kind}(s) {bad}; choose from {sorted(known)}")  # type: ignore[call-overload]


@dataclass(frozen=True)
class SimJob:
    workload: str
    pool: str
    policy: str
    workers: int
    requests_per_worker: int


@dataclass(frozen=True)
class RoutingBenchResult:
    settings: RoutingSettings
    machine: MachineInfo
    step_cost: dict[str, float]
    runs: tuple[RunFigures, ...]  # workers = settings.workers
    latency_runs: tuple[RunFigures, ...]  # workers = settings.latency_workers
    # One decision at settings.latency_workers with the index tracking host tiers vs not
    # (`bench.decision_latency`, the fleets timed in alternation); None: latency runs skipped.
    tier_latency: LatencyReport | None
    stacks: tuple[StackRun, ...]  # the model presets (stacks.py)
    real: RealResult | None  # when --real ran
    wall_s: float
    load_avg_after: float


# ---------------------------------------------------------------- the simulations


def cluster_for(s: RoutingSettings, pool: str, workers: int) -> SimCluster:
    ratio = s.swa_ratio if pool == "swa_pressure" else 1.0
    return SimCluster(
        workers=workers, page_size=s.page_size, window=s.window, full_tokens=s.full_tokens,
        swa_ratio=ratio, disable_hybrid=pool == "single_pool",
    )  # fmt: skip


def run_job(s: RoutingSettings, job: SimJob) -> RunFigures:
    """One simulation (a top-level function: `--jobs` runs it in a spawned process)."""
    import torch

    torch.set_num_threads(1)  # a few small tensor ops per step: threads would only contend
    size = WorkloadSize(job.workers, job.requests_per_worker, s.load, s.seed)
    outcome = simulate(
        cluster_for(s, job.pool, job.workers), job.policy, make_workload(job.workload, size)
    )
    return summarize(outcome, job.workload, job.pool)


def plan_jobs(s: RoutingSettings) -> tuple[list[SimJob], list[SimJob]]:
    main = [
        SimJob(w, p, pol, s.workers, s.requests_per_worker)
        for w in s.workloads for p in s.pools for pol in s.policies
    ]  # fmt: skip
    latency = [
        SimJob(LATENCY_WORKLOAD, "swa_pressure", pol, s.latency_workers, s.latency_requests_per_worker)
        for pol in s.policies
    ] if s.latency_workers else []  # fmt: skip
    return main, latency


def run_jobs(s: RoutingSettings, jobs: list[SimJob]) -> list[RunFigures]:
    return _parallel(s.jobs, run_job, [(s, j) for j in jobs], "routing simulations")


def run_stack_jobs(s: RoutingSettings) -> list[StackRun]:
    st = s.stack_settings()
    jobs = plan_stack_jobs(st) if s.models else []
    return _parallel(s.jobs, run_stack_job, [(st, j) for j in jobs], "model presets")


def _parallel(n: int, fn: Callable[..., T], args: list[tuple[object, ...]], desc: str) -> list[T]:
    if n == 1:
        return [fn(*a) for a in progress(args, desc=desc)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # NOTE: spawn, not fork: the parent has torch loaded, and forked OpenMP state can hang.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futures = [pool.submit(fn, *a) for a in args]
        return [f.result() for f in progress(futures, desc=desc)]


def run_bench(s: RoutingSettings) -> RoutingBenchResult:
    t0 = time.perf_counter()
    machine = machine_info()
    main, latency = plan_jobs(s)
    figures = run_jobs(s, main)
    # The latency runs go one at a time after the pool: their wall-clock decision times are
    # then measured without a sibling simulation competing for the cores.
    latency_figures = [run_job(s, j) for j in latency]
    tier_latency = None
    if s.latency_workers:
        from bench.decision_latency import measure

        tier_latency = measure(workers=s.latency_workers)
    stacks = run_stack_jobs(s)
    real = None
    if s.real:
        from bench.routing.real import RealSettings, run_real

        real = run_real(RealSettings(policies=s.policies, seed=s.seed))
    return RoutingBenchResult(
        settings=s,
        machine=machine,
        step_cost=dataclasses.asdict(StepCost()),
        runs=tuple(figures),
        latency_runs=tuple(latency_figures),
        tier_latency=tier_latency,
        stacks=tuple(stacks),
        real=real,
        wall_s=time.perf_counter() - t0,
        load_avg_after=load_average(),
    )

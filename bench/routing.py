"""`swaserve bench routing`: the four routing policies compared on the same traffic.

Simulated cluster (the main part, `routing_sim.py`): `--workers` real engines (scheduler, radix
cache with tombstones, hybrid allocator) whose model is `SimRunner` (no compute, virtual step
time `StepCost`), routed by the real `RouterCore` over a `ClusterIndex` fed by their cache
events. Every workload (`routing_workloads.py`) runs under every KV pool layout and policy:

| pool | meaning |
|---|---|
| `swa_pressure` | hybrid pools, SWA pool = `--swa-ratio` × full pool: the tree's SWA is evicted (tombstones) |
| `roomy_swa` | hybrid pools, SWA pool = full pool: tombstones only from window freeing of running requests |
| `single_pool` | `disable_hybrid_swa_memory`: SWA layers keep all KV, no tombstones (`swa_prefix` ≡ `prefix`) |

Then the decision latency at `--latency-workers` (64): one workload, every policy, on that many
workers. Then the model presets (`--models`, `routing_stacks.py`): GPT-OSS-120B and
MiMo-V2-Flash layer plans, an SGLang-like stack vs swaserve's full stack at SWA ratios 0.05,
0.1, 0.25 and a roomy SWA pool, prefill in token-layers next to the capacity each ratio buys.
With `--real`, the same policies also drive the real stack (`routing_real.py`).
Output: `routing.json`, `summary.md`, `routing_prefill.png`, `routing_ttft.png`,
`routing_tradeoff.png` in --output-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from bench.harness import add_output_arguments, prepare_output_dir, write_json, write_text
from bench.machine import MachineInfo
from bench.routing_figures import RunFigures
from bench.routing_sim import SimCluster
from bench.routing_stacks import PRESETS, StackRun, StackSettings
from bench.routing_workloads import WORKLOADS
from router.policies import POLICY_NAMES

T = TypeVar("T")

POOLS = ("swa_pressure", "roomy_swa", "single_pool")
LATENCY_WORKLOAD = "multi_tenant"


@dataclass(frozen=True)
class RoutingSettings:
    workers: int = 16
    requests_per_worker: int = 20
    load: float = 0.6  # of the cluster's no-cache capacity (routing_workloads.arrival_rate)
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
    stacks: tuple[StackRun, ...]  # the model presets (routing_stacks.py)
    real: object | None  # routing_real.RealResult when --real ran
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

    from bench.routing_figures import summarize
    from bench.routing_sim import simulate
    from bench.routing_workloads import WorkloadSize, make_workload

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
    from bench.routing_stacks import plan_stack_jobs, run_stack_job

    st = s.stack_settings()
    jobs = plan_stack_jobs(st) if s.models else []
    return _parallel(s.jobs, run_stack_job, [(st, j) for j in jobs], "model presets")


def _parallel(n: int, fn: Callable[..., T], args: list[tuple[object, ...]], desc: str) -> list[T]:
    from bench.harness import progress

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
    from bench.machine import load_average, machine_info
    from bench.sim_runner import StepCost

    t0 = time.perf_counter()
    machine = machine_info()
    main, latency = plan_jobs(s)
    figures = run_jobs(s, main)
    # The latency runs go one at a time after the pool: their wall-clock decision times are
    # then measured without a sibling simulation competing for the cores.
    latency_figures = [run_job(s, j) for j in latency]
    stacks = run_stack_jobs(s)
    real = None
    if s.real:
        from bench.routing_real import RealSettings, run_real

        real = run_real(RealSettings(policies=s.policies, seed=s.seed))
    return RoutingBenchResult(
        settings=s,
        machine=machine,
        step_cost=dataclasses.asdict(StepCost()),
        runs=tuple(figures),
        latency_runs=tuple(latency_figures),
        stacks=tuple(stacks),
        real=real,
        wall_s=time.perf_counter() - t0,
        load_avg_after=load_average(),
    )


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RoutingSettings()
    a = parser.add_argument
    a("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    a(
        "--requests-per-worker",
        type=int,
        default=d.requests_per_worker,
        help="requests per workload = this x workers",
    )
    a(
        "--load",
        type=float,
        default=d.load,
        help="arrival rate as a fraction of the cluster's no-cache capacity",
    )
    a("--workloads", nargs="+", default=list(d.workloads), choices=list(WORKLOADS))
    a("--pools", nargs="+", default=list(d.pools), choices=list(POOLS))
    a("--policies", nargs="+", default=list(d.policies), choices=list(POLICY_NAMES))
    a(
        "--swa-ratio",
        type=float,
        default=d.swa_ratio,
        help="SWA pool / full pool under swa_pressure",
    )
    a(
        "--full-tokens",
        type=int,
        default=d.full_tokens,
        help="full-pool tokens per simulated worker",
    )
    a("--page-size", type=int, default=d.page_size)
    a("--window", type=int, default=d.window, help="SWA window (keys to the left)")
    a(
        "--latency-workers",
        type=int,
        default=d.latency_workers,
        help="workers of the decision-latency runs (0: skip)",
    )
    a("--latency-requests-per-worker", type=int, default=d.latency_requests_per_worker)
    a("--seed", type=int, default=d.seed)
    a(
        "--jobs",
        type=int,
        default=min(2, _cpus()),
        help="simulations run in parallel processes (default: min(2, CPUs))",
    )
    a("--models", nargs="*", default=list(d.models), choices=list(PRESETS),
      help="model presets of the stack comparison (none: skip it)")  # fmt: skip
    a("--stack-requests-per-worker", type=int, default=d.stack_requests_per_worker,
      help="requests per worker of the presets' short workloads")  # fmt: skip
    a(
        "--real",
        action=argparse.BooleanOptionalAction,
        default=d.real,
        help="also route a short workload through the real stack (Ray, 2 tiny workers per policy)",
    )
    add_output_arguments(parser, "bench_results/routing")  # fmt: skip


def _cpus() -> int:
    from bench.machine import cpu_count

    return cpu_count()


def settings_from_args(args: argparse.Namespace) -> RoutingSettings:
    return RoutingSettings(
        workers=args.workers, requests_per_worker=args.requests_per_worker, load=args.load,
        workloads=tuple(args.workloads), pools=tuple(args.pools), policies=tuple(args.policies),
        swa_ratio=args.swa_ratio, full_tokens=args.full_tokens, page_size=args.page_size,
        window=args.window, latency_workers=args.latency_workers,
        latency_requests_per_worker=args.latency_requests_per_worker, seed=args.seed,
        jobs=args.jobs, real=args.real, models=tuple(args.models),
        stack_requests_per_worker=args.stack_requests_per_worker,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from bench.routing_report import console_table, write_plots, write_summary
    from worker.errors import ConfigError

    try:
        settings = settings_from_args(args)
        result = run_bench(settings)
    except (ConfigError, ValueError) as exc:
        print(f"swaserve bench routing: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    write_json(out / "routing.json", result)
    write_text(out / "summary.md", write_summary(result))
    if not args.no_plots:
        write_plots(result, out)
    print(console_table(result))
    print(f"routing bench ({result.wall_s:.0f} s) -> {out}/routing.json, summary.md")
    return 0

"""`swaserve bench routing`: the four routing policies compared on the same traffic.

Simulated cluster (the main part, `sim.py`): `--workers` real engines (scheduler, radix
cache with tombstones, hybrid allocator) whose model is `SimRunner` (no compute, virtual step
time `StepCost`), routed by the real `RouterCore` over a `ClusterIndex` fed by their cache
events. Every workload (`workloads.py`) runs under every KV pool layout and policy:

| pool | meaning |
|---|---|
| `swa_pressure` | hybrid pools, SWA pool = `--swa-ratio` × full pool: the tree's SWA is evicted (tombstones) |
| `roomy_swa` | hybrid pools, SWA pool = full pool: tombstones only from window freeing of running requests |
| `single_pool` | `disable_hybrid_swa_memory`: SWA layers keep all KV, no tombstones (`swa_prefix` ≡ `prefix`) |

Then the decision latency at `--latency-workers` (64): one workload, every policy, on that many
workers, and one decision with the index tracking host tiers vs not (`bench.decision_latency`).
Then the model presets (`--models`, `stacks.py`): GPT-OSS-120B and MiMo-V2-Flash layer plans, an
SGLang-like stack, an SGLang-HiCache-like one and swaserve's full stack (both with a host tier)
at SWA ratios 0.05, 0.1, 0.25 and a roomy SWA pool, prefill in token-layers next to the tokens
loaded and the capacity each ratio buys. With `--real`, the same policies also drive the real
stack (`real.py`).
Output in --output-dir: `routing.json`, `summary.md`, `routing_prefill.png`, `routing_ttft.png`,
`routing_tiers.png` (`runs.py` runs all of it, `report.py` writes the summary and the plots).
"""

from __future__ import annotations

import argparse
import sys

from bench.harness import add_output_arguments, prepare_output_dir, write_json, write_text
from bench.machine import cpu_count
from bench.routing.report import console_table, write_plots, write_summary
from bench.routing.runs import POOLS, RoutingSettings, run_bench
from bench.routing.stacks import PRESETS
from bench.routing.workloads import WORKLOADS
from router.policies import POLICY_NAMES


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
        default=min(2, cpu_count()),
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

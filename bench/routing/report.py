"""Markdown summary, console table and PNG plots of `swaserve bench routing`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.decision_latency import __doc__ as TIER_LATENCY_DOC
from bench.harness import markdown_table, new_figure, save_figure
from bench.routing.figures import RunFigures
from bench.routing.figures import __doc__ as FIGURES_DOC
from bench.routing.runs import LATENCY_WORKLOAD, RoutingBenchResult, RoutingSettings
from bench.routing.stacks import SCALED
from bench.routing.stacks import __doc__ as STACKS_DOC
from bench.routing.stacks_report import stacks_table, targets_table, write_tradeoff_plot

if TYPE_CHECKING:
    from matplotlib.axes import Axes

POLICY_COLORS = {"swa_prefix": "#1f77b4", "prefix": "#ff7f0e", "least_loaded": "#2ca02c",
                 "round_robin": "#9467bd"}  # fmt: skip
LATENCY_TARGET_US = 1000.0


def _find(runs: Iterable[RunFigures], workload: str, pool: str, policy: str) -> RunFigures | None:
    return next(
        (r for r in runs if (r.workload, r.pool, r.policy) == (workload, pool, policy)), None
    )


def command_line(s: RoutingSettings) -> str:
    parts = ["swaserve bench routing", f"--workers {s.workers}",
             f"--requests-per-worker {s.requests_per_worker}", f"--load {s.load:g}",
             f"--swa-ratio {s.swa_ratio:g}", f"--full-tokens {s.full_tokens}",
             f"--latency-workers {s.latency_workers}", f"--seed {s.seed}",
             " ".join(["--models", *s.models]),
             f"--stack-requests-per-worker {s.stack_requests_per_worker}"]  # fmt: skip
    if s.real:
        parts.append("--real")
    return " ".join(parts)


# ---------------------------------------------------------------- targets


def target_rows(r: RoutingBenchResult) -> list[list[str]]:
    """swa_prefix vs prefix prefill tokens per workload and pool, and what the issue targets."""
    rows = []
    for w in r.settings.workloads:
        for pool in r.settings.pools:
            a, b = _find(r.runs, w, pool, "swa_prefix"), _find(r.runs, w, pool, "prefix")
            if a is None or b is None:
                continue
            ratio = a.prefill_tokens / b.prefill_tokens if b.prefill_tokens else float("nan")
            want = {"swa_pressure": "fewer", "single_pool": "equal"}.get(pool, "(no target)")
            met = {"fewer": a.prefill_tokens < b.prefill_tokens,
                   "equal": a.prefill_tokens == b.prefill_tokens}.get(want)  # fmt: skip
            verdict = "-" if met is None else ("met" if met else "NOT met")
            rows.append([w, pool, f"{a.prefill_tokens:,}", f"{b.prefill_tokens:,}",
                         f"{ratio:.3f}", want, verdict])  # fmt: skip
    return rows


def latency_rows(r: RoutingBenchResult) -> list[list[str]]:
    rows = []
    small = [x for x in r.runs if x.workload == LATENCY_WORKLOAD and x.pool == "swa_pressure"]
    for x in [*small, *r.latency_runs]:
        met = x.decision_us_p50 < LATENCY_TARGET_US
        rows.append([x.policy, str(x.workers), str(x.requests), f"{x.decision_us_p50:.0f}",
                     f"{x.decision_us_p99:.0f}", "met" if met else "NOT met"])  # fmt: skip
    return rows


# ---------------------------------------------------------------- tables


def _run_row(x: RunFigures, base: RunFigures | None) -> list[str]:
    rel = f"{x.prefill_tokens / base.prefill_tokens:.2f}" if base and base.prefill_tokens else "-"
    return [
        x.pool, x.policy, f"{x.hit_rate:.3f}", f"{x.prefill_tokens:,}", rel,
        f"{x.ttft_p50_s * 1e3:.0f}", f"{x.ttft_p99_s * 1e3:.0f}", f"{x.throughput_tok_s:,.0f}",
        f"{x.predictions_exact}/{x.requests}", f"{x.quiet_exact}/{x.quiet_decisions}",
        f"{x.predictions_over}", f"{x.tombstone_pages:,}", str(x.max_requests_per_worker),
    ]  # fmt: skip


RUN_HEADERS = ["pool", "policy", "hit rate", "prefill tokens", "vs swa_prefix", "TTFT p50 ms",
               "TTFT p99 ms", "tok/s", "exact", "exact (quiet)", "over", "tombstone pages",
               "max req/worker"]  # fmt: skip


def workload_table(r: RoutingBenchResult, workload: str) -> str:
    rows = []
    for pool in r.settings.pools:
        base = _find(r.runs, workload, pool, "swa_prefix")
        rows += [_run_row(x, base) for x in r.runs if (x.workload, x.pool) == (workload, pool)]
    return markdown_table(RUN_HEADERS, rows)


def console_table(r: RoutingBenchResult) -> str:
    headers = ["workload", "pool", "policy", "hit rate", "prefill tokens", "TTFT p50/p99 ms",
               "tok/s", "exact"]  # fmt: skip
    rows = [[x.workload, x.pool, x.policy, f"{x.hit_rate:.3f}", f"{x.prefill_tokens:,}",
             f"{x.ttft_p50_s * 1e3:.0f}/{x.ttft_p99_s * 1e3:.0f}", f"{x.throughput_tok_s:,.0f}",
             f"{x.predictions_exact}/{x.requests}"] for x in r.runs]  # fmt: skip
    lat = markdown_table(["policy", "workers", "decisions", "p50 us", "p99 us", "< 1 ms"],
                         latency_rows(r))  # fmt: skip
    parts = [markdown_table(headers, rows), "decision latency (wall clock):", lat]
    if r.tier_latency is not None:
        parts += ["decision latency, host tiers tracked vs not:", str(r.tier_latency)]
    if r.stacks:
        parts += ["model presets, targets at ratio 0.1:", targets_table(r.stacks)]
    if r.real is not None:
        from bench.routing.real import real_table

        parts += ["real stack:", real_table(r.real)]
    return "\n\n".join(parts)


def write_summary(r: RoutingBenchResult) -> str:
    s, c = r.settings, r.step_cost
    lines = [
        "# Routing policies compared (`swaserve bench routing`)",
        f"Simulated cluster: {s.workers} workers, each a real `Engine` (scheduler, radix cache, "
        f"hybrid allocator) with a `SimRunner` (no model compute); page {s.page_size}, window "
        f"{s.window}, full pool {s.full_tokens:,} tokens; `swa_pressure` = SWA pool "
        f"{s.swa_ratio:g} x full, `roomy_swa` = SWA pool = full pool, `single_pool` = "
        "`disable_hybrid_swa_memory`. Chunked prefill 512 (the serve default), routing stats "
        "sampled every 1 s of virtual time.",
        f"Virtual step time = {c['overhead_s'] * 1e3:g} ms + {c['prefill_token_s'] * 1e6:g} us x "
        f"prefill tokens + {c['decode_token_s'] * 1e6:g} us x decoding requests + KV bytes "
        f"loaded from a host tier / {c['link_gbps']:g} GB/s.",
        f"Traffic: {s.requests_per_worker} requests per worker per workload, arrivals at "
        f"{s.load:g} x the cluster's no-cache capacity, seed {s.seed}.",
        f"Machine: {r.machine.describe()} (after: {r.load_avg_after:.2f}); {s.jobs} simulation "
        f"process(es); whole run {r.wall_s:.0f} s.",
        f"Command: `{command_line(s)}`",
        "## Targets",
        markdown_table(
            [
                "workload",
                "pool",
                "swa_prefix prefill",
                "prefix prefill",
                "swa_prefix / prefix",
                "target",
                "verdict",
            ],
            target_rows(r),
        ),  # fmt: skip
        markdown_table(
            ["policy", "workers", "decisions", "p50 us", "p99 us", "p50 < 1 ms"], latency_rows(r)
        ),  # fmt: skip
    ]
    lines.append(
        f"Decision latency is wall-clock `RouterCore.decide` time on this machine (prompts of "
        f"the {LATENCY_WORKLOAD} workload: 1-2k tokens, index fed by the run's cache events). "
        f"The {s.workers}-worker rows come from the main runs, which share the cores with "
        f"{s.jobs - 1} sibling simulation(s); the {s.latency_workers}-worker runs go alone."
    )
    if r.tier_latency is not None:
        lines += ["### Decision latency with host tiers tracked (`bench.decision_latency`)",
                  f"```\n{r.tier_latency}\n```", (TIER_LATENCY_DOC or "").strip()]  # fmt: skip
    for w in s.workloads:
        lines += [f"## {w}", workload_table(r, w)]
    if r.stacks:
        lines += stacks_summary(r)
    if r.real is not None:
        from bench.routing.real import real_summary

        lines += ["## Real stack", real_summary(r.real)]
    lines += ["## Definitions", (FIGURES_DOC or "").strip()]
    return "\n\n".join(lines)


def stacks_summary(r: RoutingBenchResult) -> list[str]:
    sizes = "; ".join(f"{w}: {SCALED[w].workers} workers, {SCALED[w].fraction * 80:g} GiB KV each, "
                      f"chunk {SCALED[w].chunk}" for w in dict.fromkeys(x.workload for x in r.stacks))  # fmt: skip
    return ["## Model presets: SGLang-like, HiCache-like and swaserve", (STACKS_DOC or "").strip(),
            f"Clusters: {sizes}; {r.settings.stack_requests_per_worker} requests per worker "
            "(short workloads).", "### Targets (ratio 0.1, host tiers on)", targets_table(r.stacks),
            "### Every ratio", stacks_table(r.stacks)]  # fmt: skip


# ---------------------------------------------------------------- plots


def _grouped(
    ax: Axes,
    r: RoutingBenchResult,
    workload: str,
    value: Callable[[RunFigures], float],
    ylabel: str,
) -> None:
    pools, policies = r.settings.pools, r.settings.policies
    width = 0.8 / len(policies)
    for i, pol in enumerate(policies):
        xs, ys = [], []
        for j, pool in enumerate(pools):
            x = _find(r.runs, workload, pool, pol)
            if x is not None:
                xs.append(j + (i - (len(policies) - 1) / 2) * width)
                ys.append(value(x))
        ax.bar(xs, ys, width, label=pol, color=POLICY_COLORS.get(pol))
    ax.set_xticks(range(len(pools)), list(pools), fontsize=8)
    ax.set_title(workload, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)


def write_plots(r: RoutingBenchResult, out: Path) -> list[Path]:
    workloads = r.settings.workloads
    fig, axes = new_figure(len(workloads), width=4.6, height=3.6)
    for ax, w in zip(axes, workloads):
        _grouped(ax, r, w, lambda x: x.prefill_tokens / 1e3, "prefill tokens computed (k)")
    axes[0].legend(fontsize=8)
    paths = [save_figure(fig, out / "routing_prefill.png")]
    fig, axes = new_figure(len(workloads), width=4.6, height=3.6)
    for ax, w in zip(axes, workloads):
        _grouped(ax, r, w, lambda x: x.ttft_p50_s * 1e3, "TTFT ms (bars p50, marks p99)")
        _p99_marks(ax, r, w)
    axes[0].legend(fontsize=8)
    paths.append(save_figure(fig, out / "routing_ttft.png"))
    if r.stacks:
        paths.append(write_tradeoff_plot(r.stacks, out))
    return paths


def _p99_marks(ax: Axes, r: RoutingBenchResult, workload: str) -> None:
    pools, policies = r.settings.pools, r.settings.policies
    width = 0.8 / len(policies)
    for i, pol in enumerate(policies):
        for j, pool in enumerate(pools):
            x = _find(r.runs, workload, pool, pol)
            if x is not None:
                ax.plot(j + (i - (len(policies) - 1) / 2) * width, x.ttft_p99_s * 1e3, "v",
                        color="black", markersize=4)  # fmt: skip

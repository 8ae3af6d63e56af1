"""Tables, targets and the trade-off plot of the model-preset runs (`bench/routing/stacks.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.harness import markdown_table, save_figure
from bench.routing.stacks import CONTEXT, POOLS, RATIOS, ROOMY, TARGET_RATIO, StackRun

ROOMY_TARGET = 1.15  # swaserve at ratio 0.1 / swaserve with a roomy SWA pool, every workload
BASELINE_TARGET = 0.5  # swaserve / sglang_like at ratio 0.1, on these workloads:
BASELINE_WORKLOADS = ("multi_tenant", "agent_branching", "long_agent")
STACK_COLORS = {"sglang_like": "#ff7f0e", "swaserve": "#1f77b4"}
TARGET_POOL = f"r{TARGET_RATIO:g}"


def _get(runs: Sequence[StackRun], model: str, workload: str, pool: str, stack: str) -> StackRun | None:
    return next(
        (r for r in runs if (r.model, r.workload, r.pool, r.stack) == (model, workload, pool, stack)),
        None,
    )


def _ratio(a: StackRun | None, b: StackRun | None) -> float | None:
    if a is None or b is None or not b.token_layers:
        return None
    return a.token_layers / b.token_layers


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def model_table(runs: Sequence[StackRun], model: str) -> str:
    """One row per workload and pool: pools, capacity, fill, both stacks' prefill token-layers."""
    headers = ["workload", "pool", "full / SWA tokens per worker", f"capacity @{CONTEXT // 1024}K (80 GiB)",
               "fill", "sglang_like prefill Gtok-layers", "swaserve prefill Gtok-layers",
               "swaserve / sglang_like", "swaserve / its roomy", "repairs (repaired tokens)",
               "hit rate sglang / swaserve", "swaserve exact predictions"]  # fmt: skip
    rows = []
    for w in dict.fromkeys(r.workload for r in runs if r.model == model):
        roomy = _get(runs, model, w, ROOMY, "swaserve")
        for pool in POOLS:
            base, ours = _get(runs, model, w, pool, "sglang_like"), _get(runs, model, w, pool, "swaserve")
            if base is None or ours is None:
                continue
            f = ours.figures
            rows.append([
                w, pool, f"{ours.full_tokens:,} / {ours.swa_tokens:,}", str(ours.capacity),
                f"{ours.fill:.2f}", f"{base.token_layers / 1e9:.3f}", f"{ours.token_layers / 1e9:.3f}",
                _fmt(_ratio(ours, base)), _fmt(_ratio(ours, roomy)),
                f"{f.repairs} ({f.repaired_tokens:,})",
                f"{base.figures.hit_rate:.3f} / {f.hit_rate:.3f}", f"{f.predictions_exact}/{f.requests}",
            ])  # fmt: skip
    return markdown_table(headers, rows)


def target_rows(runs: Sequence[StackRun]) -> list[list[str]]:
    """At ratio 0.1: swaserve vs its roomy figure (every workload) and vs sglang_like."""
    rows = []
    for model in dict.fromkeys(r.model for r in runs):
        for w in dict.fromkeys(r.workload for r in runs if r.model == model):
            ours = _get(runs, model, w, TARGET_POOL, "swaserve")
            vs_roomy = _ratio(ours, _get(runs, model, w, ROOMY, "swaserve"))
            vs_base = _ratio(ours, _get(runs, model, w, TARGET_POOL, "sglang_like"))
            roomy_ok = "-" if vs_roomy is None else ("met" if vs_roomy <= ROOMY_TARGET else "NOT met")
            base_ok = "(no target)"
            if w in BASELINE_WORKLOADS and vs_base is not None:
                base_ok = "met" if vs_base <= BASELINE_TARGET else "NOT met"
            rows.append([model, w, _fmt(vs_roomy), roomy_ok, _fmt(vs_base), base_ok])
    return rows


def targets_table(runs: Sequence[StackRun]) -> str:
    return markdown_table(
        ["model", "workload", f"swaserve r{TARGET_RATIO:g} / roomy", f"<= {ROOMY_TARGET}",
         f"swaserve / sglang_like (r{TARGET_RATIO:g})", f"<= {BASELINE_TARGET}"],
        target_rows(runs),
    )  # fmt: skip


def write_tradeoff_plot(runs: Sequence[StackRun], out: Path) -> Path:
    """One PNG: per model (rows) and workload (columns), prefill token-layers relative to
    swaserve with a roomy SWA pool against the capacity each ratio buys."""
    models = list(dict.fromkeys(r.model for r in runs))
    workloads = list(dict.fromkeys(r.workload for r in runs))
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot; the bench never opens a window
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(len(models), len(workloads), squeeze=False,
                             figsize=(3.6 * len(workloads), 3.1 * len(models)))  # fmt: skip
    axes = [ax for row in grid for ax in row]
    for i, model in enumerate(models):
        for j, w in enumerate(workloads):
            ax = axes[i * len(workloads) + j]
            roomy = _get(runs, model, w, ROOMY, "swaserve")
            for stack, color in STACK_COLORS.items():
                pts = [(x.capacity, _ratio(x, roomy)) for r in RATIOS
                       if (x := _get(runs, model, w, f"r{r:g}", stack)) is not None]  # fmt: skip
                xs = [p[0] for p in pts]
                ys = [p[1] or 0.0 for p in pts]
                ax.plot(xs, ys, "o-", color=color, label=stack)
                for (cx, cy), r in zip(zip(xs, ys), RATIOS):
                    ax.annotate(f"{r:g}", (cx, cy), fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.axhline(ROOMY_TARGET, color="gray", lw=0.8, ls="--")
            ax.set_title(f"{model}: {w}", fontsize=8)
            ax.set_xlabel(f"concurrent {CONTEXT // 1024}K requests on 80 GiB", fontsize=7)
            ax.set_ylabel("prefill token-layers / roomy", fontsize=7)
    axes[0].legend(fontsize=7)
    return save_figure(fig, out / "routing_tradeoff.png")

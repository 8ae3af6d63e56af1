"""Tables, targets and the trade-off plot of the model-preset runs (`bench/routing/stacks.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.harness import markdown_table, save_figure
from bench.routing.stacks import CONTEXT, POOLS, RATIOS, ROOMY, STACK_NAMES, TARGET_RATIO, StackRun

ROOMY_TARGET = 1.0  # swaserve at ratio 0.1 with its host tier / the roomy pool without one
BASELINE_TARGET = 0.5  # swaserve / sglang_like at ratio 0.1, on these workloads:
BASELINE_WORKLOADS = ("multi_tenant", "agent_branching")
HICACHE_TARGET = 1.0  # swaserve / hicache_like at ratio 0.1, every workload: not worse
STACK_COLORS = {"sglang_like": "#ff7f0e", "hicache_like": "#2ca02c", "swaserve": "#1f77b4"}
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


def _verdict(x: float | None, bound: float) -> str:
    return "-" if x is None else ("met" if x <= bound else "NOT met")


def _k(tokens: int) -> str:
    return f"{tokens / 1e3:,.1f}k" if tokens else "0"


def _loaded(r: StackRun | None) -> str:
    """Tokens loaded from the host tier, full + SWA."""
    if r is None:
        return "-"
    f = r.figures
    return f"{_k(f.loaded_full_tokens)} + {_k(f.loaded_swa_tokens)}"


TABLE_HEADERS = [
    "model", "workload", "pool", "full / SWA tokens per worker", "host full / SWA tokens",
    f"capacity @{CONTEXT // 1024}K (80 GiB)", "fill", "sglang_like prefill Gtok-layers",
    "hicache_like", "swaserve", "swaserve / sglang_like", "swaserve / hicache_like",
    "swaserve / roomy", "loaded full + SWA tokens hicache / swaserve", "repairs (repaired tokens)",
    "hit rate sglang / hicache / swaserve", "swaserve exact predictions (loaded)",
]  # fmt: skip


def _row(runs: Sequence[StackRun], model: str, w: str, pool: str) -> list[str] | None:
    base, hi, ours = (_get(runs, model, w, pool, s) for s in STACK_NAMES)
    if base is None or ours is None:
        return None
    roomy = _get(runs, model, w, ROOMY, "swaserve")
    f = ours.figures
    hits = " / ".join("-" if x is None else f"{x.figures.hit_rate:.3f}" for x in (base, hi, ours))
    return [
        model, w, pool, f"{ours.full_tokens:,} / {ours.swa_tokens:,}",
        f"{ours.host_full_tokens:,} / {ours.host_swa_tokens:,}" if ours.host_full_tokens else "-",
        str(ours.capacity), f"{ours.fill:.2f}", f"{base.token_layers / 1e9:.3f}",
        "-" if hi is None else f"{hi.token_layers / 1e9:.3f}", f"{ours.token_layers / 1e9:.3f}",
        _fmt(_ratio(ours, base)), _fmt(_ratio(ours, hi)), _fmt(_ratio(ours, roomy)),
        f"{_loaded(hi)} / {_loaded(ours)}", f"{f.repairs} ({f.repaired_tokens:,})", hits,
        f"{f.predictions_exact}/{f.requests} ({f.loaded_predictions_exact})",
    ]  # fmt: skip


def stacks_table(runs: Sequence[StackRun]) -> str:
    """One row per model, workload and pool: pools (device and host), capacity, fill, the three
    stacks' prefill token-layers and ratios, tokens loaded, hit rates, exact predictions."""
    rows = []
    for model in dict.fromkeys(r.model for r in runs):
        for w in dict.fromkeys(r.workload for r in runs if r.model == model):
            rows += [row for pool in POOLS if (row := _row(runs, model, w, pool)) is not None]
    return markdown_table(TABLE_HEADERS, rows)


def target_rows(runs: Sequence[StackRun]) -> list[list[str]]:
    """At ratio 0.1 (host tiers on): swaserve vs the roomy pool without a tier (every workload),
    vs sglang_like (`BASELINE_WORKLOADS`), vs hicache_like (every workload)."""
    rows = []
    for model in dict.fromkeys(r.model for r in runs):
        for w in dict.fromkeys(r.workload for r in runs if r.model == model):
            ours = _get(runs, model, w, TARGET_POOL, "swaserve")
            vs_roomy = _ratio(ours, _get(runs, model, w, ROOMY, "swaserve"))
            vs_base = _ratio(ours, _get(runs, model, w, TARGET_POOL, "sglang_like"))
            hi = _get(runs, model, w, TARGET_POOL, "hicache_like")
            vs_hi = _ratio(ours, hi)
            hi_roomy = _ratio(hi, _get(runs, model, w, ROOMY, "swaserve"))
            base_ok = _verdict(vs_base, BASELINE_TARGET) if w in BASELINE_WORKLOADS else "(no target)"
            rows.append([model, w, _fmt(vs_roomy), _verdict(vs_roomy, ROOMY_TARGET), _fmt(vs_base),
                         base_ok, _fmt(vs_hi), _verdict(vs_hi, HICACHE_TARGET), _fmt(hi_roomy)])  # fmt: skip
    return rows


def targets_table(runs: Sequence[StackRun]) -> str:
    return markdown_table(
        ["model", "workload", f"swaserve {TARGET_POOL} / roomy", f"<= {ROOMY_TARGET}",
         f"swaserve / sglang_like ({TARGET_POOL})", f"<= {BASELINE_TARGET}",
         "swaserve / hicache_like", f"<= {HICACHE_TARGET}", "hicache_like / roomy"],
        target_rows(runs),
    )  # fmt: skip


def write_tradeoff_plot(runs: Sequence[StackRun], out: Path) -> Path:
    """One PNG: per model (rows) and workload (columns), prefill token-layers relative to the
    roomy pool without a tier against the capacity each ratio buys, one line per stack."""
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
            ax.axhline(ROOMY_TARGET, color="gray", lw=0.8)
            ax.set_title(f"{model}: {w}", fontsize=8)
            ax.set_xlabel(f"concurrent {CONTEXT // 1024}K requests on 80 GiB", fontsize=7)
            ax.set_ylabel("prefill token-layers / roomy (no tier)", fontsize=7)
    axes[0].legend(fontsize=7)
    return save_figure(fig, out / "routing_tiers.png")

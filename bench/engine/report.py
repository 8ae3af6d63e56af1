"""Markdown summary and PNG plot of `swaserve bench engine` (numbers come from measure.py)."""

from __future__ import annotations

from pathlib import Path

from bench.engine.measure import BatchResult, EngineBenchResult, EngineSettings
from bench.harness import markdown_table, new_figure, save_figure


def command_line(r: EngineBenchResult) -> str:
    """The `swaserve bench engine` flags that reproduce these settings."""
    s = r.settings
    parts = ["swaserve bench engine"]
    if s.model != "tiny":
        parts += ["--model", s.model]
    if s.hidden is not None:
        parts += ["--hidden", str(s.hidden)]
    if s.layers is not None:
        parts += ["--layers", str(s.layers)]
    parts += ["--batch-sizes", *map(str, s.batch_sizes), "--prompt-len", str(s.prompt_len),
              "--max-new-tokens", str(s.max_new_tokens), "--runs", str(s.runs)]  # fmt: skip
    if s.threads is not None:
        parts += ["--threads", str(s.threads)]
    if s.time_budget_s != EngineSettings().time_budget_s:
        parts += ["--time-budget", f"{s.time_budget_s:g}"]
    return " ".join(parts)


def results_table(r: EngineBenchResult) -> str:
    headers = ["batch", "runs", "ours tok/s", "transformers tok/s", "ours / transformers", "ours s",
               "transformers s", "prefill ours ms", "prefill transformers ms", "full peak / total",
               "SWA peak / total", "greedy agree"]  # fmt: skip
    return markdown_table(headers, [_row(b) for b in r.batches])


def _row(b: BatchResult) -> list[str]:
    agree = f"{b.agree}/{b.batch_size}"
    if b.first_mismatch is not None:
        agree += f" (first diff at token {b.first_mismatch})"
    return [
        str(b.batch_size), str(len(b.ours.all_wall_s)), f"{b.ours.tokens_per_s:.1f}", f"{b.transformers.tokens_per_s:.1f}",
        f"{b.speedup:.2f}x", f"{b.ours.wall_s:.2f}", f"{b.transformers.wall_s:.2f}",
        f"{b.ours.prefill_s * 1e3:.0f}", f"{b.transformers.prefill_s * 1e3:.0f}",
        f"{b.full_peak_used:,} / {b.full_total:,}", f"{b.swa_peak_used:,} / {b.swa_total:,}", agree,
    ]  # fmt: skip


def write_summary(r: EngineBenchResult) -> str:
    s, m = r.settings, r.model
    lines = [
        "# Engine throughput: swaserve vs transformers `generate`",
        f"Model: {m.name} ({m.model_type}, hidden {m.hidden_size}, {m.num_layers} layers, "
        f"{m.parameters / 1e6:.2f} M parameters), float32 on {s.device}; transformers attention: "
        f"{r.hf_attn_implementation}. Prompts: random ids, {s.prompt_len // 2}-{s.prompt_len} tokens; "
        f"greedy, {s.max_new_tokens} new tokens each; best of up to {s.runs} run(s) after a "
        "warm-up (column *runs*).",
        f"Machine: {r.machine.describe()} (after: {r.load_avg_after:.2f}).{_load_warning(r)}",
        f"Command: `{command_line(r)}`",
        results_table(r),
        "*tok/s* = batch x new tokens / wall seconds of the whole generate call (prefill "
        "included). *prefill* = the same call with 1 new token. Peaks are KV tokens held by "
        "requests (engine `stats()`), next to the pool sizes.",
    ]
    return "\n\n".join(lines)


def _load_warning(r: EngineBenchResult) -> str:
    m = r.machine
    if max(m.load_avg_1m, r.load_avg_after) < m.cpus or m.torch_threads == 1:
        return ""
    # NOTE: each torch op waits for all its OpenMP threads; when other processes hold the cores,
    # those waits (not the work) dominate and the two sides' figures become noise.
    return (
        f" **The machine was busy** (load above its {m.cpus} CPUs) and torch ran "
        f"{m.torch_threads} threads: timings mostly measure waiting for descheduled threads; "
        "rerun when idle or with `--threads 1`."
    )


def write_plot(r: EngineBenchResult, path: Path) -> Path:
    """Grouped bars per batch size: tokens/s of both sides, the ratio over our bar."""
    fig, (ax,) = new_figure(1, width=6.5, height=4.0)
    xs = range(len(r.batches))
    w = 0.38
    ours = [b.ours.tokens_per_s for b in r.batches]
    theirs = [b.transformers.tokens_per_s for b in r.batches]
    ax.bar([x - w / 2 for x in xs], ours, w, label="swaserve Engine", color="#1f77b4")
    ax.bar([x + w / 2 for x in xs], theirs, w, label="transformers generate", color="#ff7f0e")
    for x, b in zip(xs, r.batches):
        ax.annotate(
            f"{b.speedup:.2f}x",
            (x - w / 2, b.ours.tokens_per_s),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(list(xs), [f"batch {b.batch_size}" for b in r.batches])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(
        f"{r.model.name}: greedy, {r.settings.max_new_tokens} new tokens, "
        f"{r.machine.torch_threads} torch thread(s)",
        fontsize=10,
    )
    ax.legend(fontsize=9)
    return save_figure(fig, path)

"""`cluster-compare` results: one record per (stack, KV size, round, workload), the tables, the PNG."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.compare.cluster_stacks import PEER, Counters, StackConfig
from bench.compare.foreign_load import ForeignLoad
from bench.compare.stream_client import StreamRun
from bench.harness import markdown_table, new_figure, save_figure
from bench.routing.figures import quantile


@dataclass(frozen=True)
class ClusterRun:
    """One request stream against one stack."""

    config: StackConfig
    kv: str  # "pressured" | "roomy"
    kv_bytes: int  # per replica
    round: int
    workload: str
    requests: int
    failed: int
    prompt_tokens: int  # the responses' usage
    output_tokens: int
    counters: Counters  # the server's own, over the run
    counters_settled: bool  # its prompt-token counter reached the responses' sum in time
    ttft_p50_s: float
    ttft_p99_s: float
    duration_s: float
    load: ForeignLoad
    prompts_digest: str
    distinct_prompt_tokens: int  # of the prompts sent, tokenized
    errors: tuple[str, ...]  # the first few failures

    @property
    def finished(self) -> int:
        return self.requests - self.failed

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0


def run_record(
    config: StackConfig, kv: str, kv_bytes: int, round_: int, workload: str, run: StreamRun,
    counters: Counters, settled: bool, load: ForeignLoad, distinct: int,
) -> ClusterRun:  # fmt: skip
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft_s for r in ok] or [0.0]
    return ClusterRun(
        config, kv, kv_bytes, round_, workload, len(run.results), len(run.results) - len(ok),
        sum(r.prompt_tokens for r in ok), sum(r.completion_tokens for r in ok), counters, settled,
        quantile(ttfts, 0.5), quantile(ttfts, 0.99), run.duration_s, load, run.prompts_digest,
        distinct, tuple(r.error for r in run.results if not r.ok)[:5],
    )  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One (workload, KV size, stack) over its rounds: means, and the runs behind them."""

    workload: str
    kv: str
    config: StackConfig
    runs: tuple[ClusterRun, ...]

    def mean(self, value: Callable[[ClusterRun], float]) -> float:
        return sum(map(value, self.runs)) / len(self.runs)


def cells(records: Sequence[ClusterRun]) -> list[Cell]:
    """Records grouped by (workload, KV size, stack), in first-seen order."""
    groups: dict[tuple[str, str, StackConfig], list[ClusterRun]] = {}
    for r in records:
        groups.setdefault((r.workload, r.kv, r.config), []).append(r)
    ordered = sorted(groups, key=lambda k: (_first(records, k[0], "workload"), k[1] != "pressured"))
    return [Cell(w, kv, c, tuple(groups[(w, kv, c)])) for w, kv, c in ordered]


def _first(records: Sequence[ClusterRun], value: str, field: str) -> int:
    return next(i for i, r in enumerate(records) if getattr(r, field) == value)


def summary_table(all_cells: Sequence[Cell]) -> str:
    headers = ["workload", "KV / replica", "stack", "prompt tokens", "computed (first admission)",
               "÷ Ray Serve LLM", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "finished / failed",
               "preemptions", "foreign load (cores)", "1-min load"]  # fmt: skip
    rows = []
    for c in all_cells:
        peer = next((x for x in all_cells if (x.workload, x.kv, x.config.stack) == (c.workload, c.kv, PEER)), None)
        computed = c.mean(lambda r: r.counters.computed_first)
        ratio = "-" if peer is None else f"{computed / max(1.0, peer.mean(lambda r: r.counters.computed_first)):.2f}x"
        rows.append([
            c.workload, f"{c.runs[0].kv} {c.runs[0].kv_bytes / 2**20:.0f} MiB", c.config.label,
            f"{c.mean(lambda r: r.prompt_tokens) / 1000:.1f}K", f"{computed / 1000:.1f}K", ratio,
            f"{1000 * c.mean(lambda r: r.ttft_p50_s):.0f}", f"{1000 * c.mean(lambda r: r.ttft_p99_s):.0f}",
            f"{c.mean(lambda r: r.output_throughput):.1f}",
            f"{sum(r.finished for r in c.runs)} / {sum(r.failed for r in c.runs)}",
            f"{c.mean(lambda r: r.counters.preemptions):.0f}",
            f"{c.mean(lambda r: r.load.foreign_cores):.2f}",
            " ".join(f"{r.load.load_before:.1f}→{r.load.load_after:.1f}" for r in c.runs),
        ])  # fmt: skip
    return markdown_table(headers, rows)


def runs_table(records: Sequence[ClusterRun]) -> str:
    headers = ["round", "workload", "KV", "stack", "requests", "failed", "prompt tokens",
               "computed (first admission)", "vLLM queries − hits", "TTFT p50 ms", "TTFT p99 ms",
               "output tok/s", "s", "foreign cores", "1-min load", "counters settled", "stream"]  # fmt: skip
    rows = [[
        r.round, r.workload, r.kv, r.config.label, r.requests, r.failed, r.prompt_tokens,
        f"{r.counters.computed_first:.0f}",
        "-" if r.counters.queried_minus_hit is None else f"{r.counters.queried_minus_hit:.0f}",
        f"{1000 * r.ttft_p50_s:.0f}", f"{1000 * r.ttft_p99_s:.0f}", f"{r.output_throughput:.1f}",
        f"{r.duration_s:.0f}", f"{r.load.foreign_cores:.2f}",
        f"{r.load.load_before:.1f}→{r.load.load_after:.1f}", "yes" if r.counters_settled else "no",
        r.prompts_digest[:8],
    ] for r in records]  # fmt: skip
    return markdown_table(headers, rows)


def plot(all_cells: Sequence[Cell], path: Path) -> Path:
    """Computed prompt tokens and TTFT p50 per (workload, KV size), one bar per stack."""
    groups = list(dict.fromkeys((c.workload, c.kv) for c in all_cells))
    configs = list(dict.fromkeys(c.config for c in all_cells))
    fig, (ax_tokens, ax_ttft) = new_figure(2, width=max(6.0, 1.1 * len(groups)), height=4.2)
    width = 0.8 / max(1, len(configs))
    for j, config in enumerate(configs):
        xs, tokens, ttft = [], [], []
        for i, (w, kv) in enumerate(groups):
            cell = next((c for c in all_cells if (c.workload, c.kv, c.config) == (w, kv, config)), None)
            if cell is not None:
                xs.append(i + (j - (len(configs) - 1) / 2) * width)
                tokens.append(cell.mean(lambda r: r.counters.computed_first) / 1000)
                ttft.append(1000 * cell.mean(lambda r: r.ttft_p50_s))
        ax_tokens.bar(xs, tokens, width, label=config.label)
        ax_ttft.bar(xs, ttft, width, label=config.label)
    labels = [f"{w}\n{kv}" for w, kv in groups]
    for ax, title in ((ax_tokens, "prompt tokens computed (K)"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xticks(range(len(groups)), labels, fontsize=7)
        ax.set_title(title)
    ax_tokens.legend(fontsize=7)
    return save_figure(fig, path)

"""`vllm-compare` results: per-run records, the best-run table with ratios, and summary.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.compare.client import ClientResult
from bench.harness import markdown_table

SERVERS = ("vllm", "swaserve")


@dataclass(frozen=True)
class RunRecord:
    """One client run against one server."""

    server: str
    round: int
    workload: str
    client: ClientResult
    prompt_tokens: float  # from the server's counters over the run
    cached_tokens: float
    cpu_s: dict[str, float]  # process role -> CPU seconds during the run
    load_before: float  # 1-minute load average
    load_after: float

    def cpu_per_1k_tokens(self, role: str) -> float | None:
        if role not in self.cpu_s or not self.client.output_tokens:
            return None
        return 1000.0 * self.cpu_s[role] / self.client.output_tokens


@dataclass(frozen=True)
class Comparison:
    """One workload: each server's best run (highest output throughput) and the ratios."""

    workload: str
    best: dict[str, RunRecord]

    @property
    def throughput_ratio(self) -> float:
        return _ratio(self.best, lambda r: r.client.output_throughput)

    @property
    def tpot_ratio(self) -> float:
        return _ratio(self.best, lambda r: r.client.mean_tpot_ms)


def _ratio(best: dict[str, RunRecord], value: Callable[[RunRecord], float]) -> float:
    """swaserve's value over vLLM's."""
    ours, theirs = value(best["swaserve"]), value(best["vllm"])
    return ours / theirs if theirs else float("nan")


def compare(records: Sequence[RunRecord]) -> list[Comparison]:
    """Per workload (in first-seen order), the best run of each server; workloads that lack a
    server are left out."""
    out = []
    for workload in dict.fromkeys(r.workload for r in records):
        best = {}
        for server in SERVERS:
            runs = [r for r in records if r.workload == workload and r.server == server]
            if runs:
                best[server] = max(runs, key=lambda r: r.client.output_throughput)
        if len(best) == len(SERVERS):
            out.append(Comparison(workload, best))
    return out


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    headers = ["workload", "vLLM tok/s", "swaserve tok/s", "ours ÷ vLLM", "vLLM TPOT ms",
               "swaserve TPOT ms", "TPOT ours ÷ vLLM", "cached / prompt tokens (vLLM; ours)",
               "load (vLLM; ours)"]  # fmt: skip
    rows = []
    for c in comparisons:
        v, s = c.best["vllm"], c.best["swaserve"]
        rows.append([
            c.workload, f"{v.client.output_throughput:.1f}", f"{s.client.output_throughput:.1f}",
            f"**{c.throughput_ratio:.2f}x**", f"{v.client.mean_tpot_ms:.1f}",
            f"{s.client.mean_tpot_ms:.1f}", f"{c.tpot_ratio:.2f}x",
            f"{_tokens(v)}; {_tokens(s)}", f"{_load(v)}; {_load(s)}",
        ])  # fmt: skip
    return markdown_table(headers, rows)


def runs_table(records: Sequence[RunRecord]) -> str:
    """Every run, in order, with the CPU seconds per 1,000 output tokens of each process role."""
    roles = sorted({role for r in records for role in r.cpu_s})
    headers = ["round", "server", "workload", "tok/s", "mean TPOT ms", "mean TTFT ms", "load",
               *(f"{role} CPU-s / 1k tok" for role in roles)]  # fmt: skip
    rows = []
    for r in records:
        per_k = [r.cpu_per_1k_tokens(role) for role in roles]
        rows.append([
            r.round, r.server, r.workload, f"{r.client.output_throughput:.1f}",
            f"{r.client.mean_tpot_ms:.1f}", f"{r.client.mean_ttft_ms:.0f}", _load(r),
            *("-" if x is None else f"{x:.2f}" for x in per_k),
        ])  # fmt: skip
    return markdown_table(headers, rows)


def _tokens(r: RunRecord) -> str:
    return f"{r.cached_tokens / 1000:.1f}K / {r.prompt_tokens / 1000:.1f}K"


def _load(r: RunRecord) -> str:
    return f"{r.load_before:.1f}→{r.load_after:.1f}"

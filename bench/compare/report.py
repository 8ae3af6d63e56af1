"""`vllm-compare` results: per-run records, the best-run table with ratios, and summary.md.

The serving-path table reads the HTTP side: vLLM's API server against our ingress and worker
replicas, the processes between the client and the engine. Its CPU per 1,000 output tokens is
also given above each server's idle floor (what those processes spend a second doing nothing,
measured before the runs, times the run's duration, taken out): a Ray replica's floor is a
per-second cost that a slow engine's few tokens a second make look like a per-token one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.compare.client import ClientResult
from bench.harness import markdown_table

SERVERS = ("vllm", "swaserve")
# The processes between the client and the engine, per server.
HTTP_ROLES: dict[str, tuple[str, ...]] = {"vllm": ("api_server",), "swaserve": ("ingress", "worker")}


@dataclass(frozen=True)
class IdleRecord:
    """One server's processes left alone after its start and warm-up requests."""

    server: str
    round: int
    seconds: float
    cpu_s: dict[str, float]  # process role -> CPU seconds over `seconds`

    def rate(self, roles: Sequence[str]) -> float:
        """CPU seconds per second of those roles together (the share of one core)."""
        return sum(self.cpu_s.get(role, 0.0) for role in roles) / self.seconds if self.seconds > 0 else 0.0


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

    def http_per_1k_tokens(self, idle: IdleRecord | None = None) -> float | None:
        """The HTTP side's CPU seconds per 1,000 output tokens; with `idle`, less its floor
        over the run's duration. None when a role was not measured."""
        roles = HTTP_ROLES[self.server]
        if not self.client.output_tokens or any(role not in self.cpu_s for role in roles):
            return None
        cpu = sum(self.cpu_s[role] for role in roles)
        if idle is not None:
            cpu -= idle.rate(roles) * self.client.duration_s
        return 1000.0 * cpu / self.client.output_tokens


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

    @property
    def ttft_ratio(self) -> float:
        return _ratio(self.best, lambda r: r.client.mean_ttft_ms)

    @property
    def p99_ttft_ratio(self) -> float:
        return _ratio(self.best, lambda r: r.client.p99_ttft_ms)

    def http_ratio(self, idles: Sequence[IdleRecord] | None = None) -> float:
        """The HTTP side's CPU per token, ours over vLLM's; with `idles`, each above its floor
        (the idle record of the same server and round as its best run). NaN when a figure is
        missing."""
        per_1k = {}
        for server, run in self.best.items():
            idle = None
            if idles is not None:
                idle = idle_of(idles, run)
                if idle is None:
                    return float("nan")
            value = run.http_per_1k_tokens(idle)
            if value is None:
                return float("nan")
            per_1k[server] = value
        return per_1k["swaserve"] / per_1k["vllm"] if per_1k["vllm"] else float("nan")


def idle_of(idles: Sequence[IdleRecord], run: RunRecord) -> IdleRecord | None:
    return next((i for i in idles if i.server == run.server and i.round == run.round), None)


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


def serving_table(comparisons: Sequence[Comparison], idles: Sequence[IdleRecord]) -> str:
    """Per workload, the serving path's figures of each server's best run: TTFT, and the HTTP
    side's CPU per 1,000 output tokens, whole and above its idle floor."""
    headers = ["workload", "mean TTFT ms (vLLM; ours)", "ours ÷ vLLM", "p99 TTFT ms (vLLM; ours)",
               "ours ÷ vLLM", "HTTP side CPU-s/1k (vLLM; ours)", "ours ÷ vLLM",
               "above idle (vLLM; ours)", "ours ÷ vLLM"]  # fmt: skip
    rows = []
    for c in comparisons:
        v, s = c.best["vllm"], c.best["swaserve"]
        rows.append([
            c.workload, f"{v.client.mean_ttft_ms:,.0f}; {s.client.mean_ttft_ms:,.0f}", f"{c.ttft_ratio:.2f}x",
            f"{v.client.p99_ttft_ms:,.0f}; {s.client.p99_ttft_ms:,.0f}", f"{c.p99_ttft_ratio:.2f}x",
            f"{_num(v.http_per_1k_tokens())}; {_num(s.http_per_1k_tokens())}", f"{c.http_ratio():.2f}x",
            f"{_above(v, idles)}; {_above(s, idles)}", f"{c.http_ratio(idles):.2f}x" if idles else "-",
        ])  # fmt: skip
    return markdown_table(headers, rows)


def idle_table(idles: Sequence[IdleRecord]) -> str:
    """Each server's processes at rest, in per cent of one core."""
    roles = sorted({role for i in idles for role in i.cpu_s})
    headers = ["round", "server", "seconds", *(f"{role} % of a core" for role in roles), "HTTP side % of a core"]
    rows = [
        [i.round, i.server, f"{i.seconds:.0f}",
         *("-" if role not in i.cpu_s else f"{100 * i.cpu_s[role] / i.seconds:.2f}" for role in roles),
         f"{100 * i.rate(HTTP_ROLES[i.server]):.2f}"]
        for i in idles if i.seconds > 0
    ]  # fmt: skip
    return markdown_table(headers, rows)


def _above(r: RunRecord, idles: Sequence[IdleRecord]) -> str:
    idle = idle_of(idles, r)
    return "-" if idle is None else _num(r.http_per_1k_tokens(idle))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _tokens(r: RunRecord) -> str:
    return f"{r.cached_tokens / 1000:.1f}K / {r.prompt_tokens / 1000:.1f}K"


def _load(r: RunRecord) -> str:
    return f"{r.load_before:.1f}→{r.load_after:.1f}"

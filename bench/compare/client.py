"""The client side of `swaserve bench vllm-compare`: `vllm bench serve` runs and their results.

Every workload is one `vllm bench serve --backend openai` run (streaming `/v1/completions`,
`--ignore-eos`, greedy, `--max-concurrency N`), the same command line against either server.
Each workload has its own dataset seed, so no workload finds the previous one's prompts in a
server's prefix cache; both servers see identical prompts. The shared-prefix workload is vLLM's
`prefix_repetition` dataset: `num_prefixes` random prefixes of `prefix_len` tokens, each followed
by `num_prompts / num_prefixes` different random suffixes of `suffix_len` tokens.

`prompt_tokens` / `cached_tokens` per run come from each server's Prometheus counters, read
before and after the run (`vllm:prompt_tokens{,_cached}_total`,
`swaserve_{,cached_}prompt_tokens_total`).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PROMPT_COUNTERS = {
    "vllm": ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total"),
    "swaserve": ("swaserve_prompt_tokens_total", "swaserve_cached_prompt_tokens_total"),
}


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: str  # "random" | "prefix_repetition"
    concurrency: int
    seed: int
    num_prompts: int = 64
    output_len: int = 64
    input_len: int = 256  # random
    prefix_len: int = 256  # prefix_repetition
    suffix_len: int = 64
    num_prefixes: int = 4

    def dataset_args(self) -> list[str]:
        if self.dataset == "random":
            return ["--dataset-name", "random", "--random-input-len", str(self.input_len),
                    "--random-output-len", str(self.output_len)]  # fmt: skip
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len)]  # fmt: skip


def default_workloads(
    num_prompts: int = 64,
    output_len: int = 64,
    input_len: int = 256,
    concurrencies: tuple[int, ...] = (1, 8, 32),
    shared_prefix_concurrency: int = 8,
) -> tuple[Workload, ...]:
    """Random prompts at each concurrency, then the shared-prefix dataset."""
    random = [
        Workload(f"random c={c}", "random", c, seed=100 + i, num_prompts=num_prompts,
                 output_len=output_len, input_len=input_len)  # fmt: skip
        for i, c in enumerate(concurrencies)
    ]
    shared = Workload(
        f"shared prefix c={shared_prefix_concurrency}", "prefix_repetition",
        shared_prefix_concurrency, seed=200, num_prompts=num_prompts, output_len=output_len,
        prefix_len=input_len, suffix_len=max(1, input_len // 4),
    )  # fmt: skip
    return (*random, shared)


def client_command(
    vllm: Path, workload: Workload, url: str, model_dir: Path, result: Path
) -> list[str]:
    """The `vllm bench serve` command line of one run (its JSON goes to `result`)."""
    return [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", url,
        "--model", str(model_dir), "--tokenizer", str(model_dir),
        *workload.dataset_args(),
        "--num-prompts", str(workload.num_prompts), "--max-concurrency", str(workload.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(workload.seed),
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


@dataclass(frozen=True)
class ClientResult:
    """What one `vllm bench serve` run measured (its saved JSON)."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_throughput: float  # output tokens/s over the run
    mean_tpot_ms: float  # per request: (latency - TTFT) / (output tokens - 1), averaged
    median_tpot_ms: float
    mean_ttft_ms: float
    mean_itl_ms: float
    p99_ttft_ms: float = float("nan")  # NaN: the run's JSON had no TTFT percentiles


def parse_result(path: Path) -> ClientResult:
    d = json.loads(path.read_text())
    return ClientResult(
        completed=int(d["completed"]),
        failed=int(d.get("failed", 0)),
        duration_s=float(d["duration"]),
        input_tokens=int(d["total_input_tokens"]),
        output_tokens=int(d["total_output_tokens"]),
        output_throughput=float(d["output_throughput"]),
        mean_tpot_ms=float(d["mean_tpot_ms"]),
        median_tpot_ms=float(d["median_tpot_ms"]),
        mean_ttft_ms=float(d["mean_ttft_ms"]),
        mean_itl_ms=float(d["mean_itl_ms"]),
        p99_ttft_ms=float(d.get("p99_ttft_ms", "nan")),  # in `--percentile-metrics` by default
    )


def run_client(command: list[str], result: Path, log: Path, timeout_s: float) -> ClientResult:
    """Run one client command; its output goes to `log`.

    Raises:
        RuntimeError: it failed, timed out or some request failed (the log tail says why).
    """
    result.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        try:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"client timed out after {timeout_s:.0f}s; log {log}") from None
    if proc.returncode != 0 or not result.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"client exited {proc.returncode}; log {log}:\n{tail}")
    parsed = parse_result(result)
    if parsed.failed:
        raise RuntimeError(f"{parsed.failed} requests failed; log {log}")
    return parsed


def prompt_counters(server: str, url: str) -> tuple[float, float]:
    """(prompt tokens, cached prompt tokens) so far, from the server's `/metrics`."""
    names = PROMPT_COUNTERS[server]
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    return counter_sum(text, names[0]), counter_sum(text, names[1])


def counter_sum(metrics_text: str, name: str) -> float:
    """The sum of every sample of `name` (any labels) in a Prometheus text exposition."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total

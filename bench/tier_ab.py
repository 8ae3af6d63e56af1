"""`swaserve bench tier-ab`: the host KV tier on vs off, served (Ray Serve, 2 tiny workers).

One local Ray cluster on loopback. Each side deploys the swaserve application with device pools
small enough to evict (the tiny model: 2,048 full and 256 SWA tokens per worker, page 16), with
a 64 MiB host tier (`on`) or none (`off`), sends the same seeded request stream one request at a
time, and deletes the application and its cache-index actor, so every side starts from cold
caches. The sides alternate (`off, on, off, on, …` for `--repeats`) so both see the same machine.

The stream revisits prefixes after the others pushed them off the device: `--heads` heads of
`--head-tokens` random tokens, each sent `--rounds` times with a fresh tail (head 0..N-1, then
again), as `/v1/completions` with token ids, streamed. `prefill_tflops: 1.0` tells the workers
what a prefill costs on this CPU against a load (docs/design.md §9.9), so a load is chosen over
recomputing, as the default prices choose it on a GPU node.

Per request: `usage.prompt_tokens_details.cached_tokens` (prompt tokens whose forward was
skipped: prefill = prompt − cached), the loaded and repaired tokens and the time to the first
streamed text (TTFT, wall clock). NOTE: a stream's headers leave before the engine admits the
request, so they carry no loaded / repaired counts (`x-swaserve-loaded-tokens` is for
non-streamed answers); each request's are the growth of the ingress's Prometheus counters
(`swaserve_loaded_prompt_tokens`, `swaserve_repaired_prompt_tokens`), which it counts before it
sends `[DONE]`, read after it (requests go one at a time, through one ingress replica).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.harness import (
    add_output_arguments,
    markdown_table,
    prepare_output_dir,
    write_json,
    write_text,
)
from bench.local_serve import deployed, local_serve
from bench.machine import MachineInfo, load_average, machine_info

if TYPE_CHECKING:
    from deploy.config import ServeConfig

MODEL = "tiny"
SIDES = ("off", "on")
HOST_KV_BYTES = 64 * 1024**2  # the tiny model's 1 KiB full + 4 KiB SWA per token: ~13K tokens
# The served config of both sides but `host_kv_bytes` (tests/deploy/openai/test_tier_e2e.py's).
ENGINE = {
    "page_size": 16, "max_total_tokens": 2048, "swa_full_tokens_ratio": 0.125,
    "chunked_prefill_size": 512, "prefill_tflops": 1.0,
}  # fmt: skip


@dataclass(frozen=True)
class TierABSettings:
    workers: int = 2
    num_cpus: int = 2
    heads: int = 16
    head_tokens: int = 300
    rounds: int = 3
    tail_tokens: int = 12  # round r's tail: this + r tokens (a fresh suffix every visit)
    max_tokens: int = 2
    repeats: int = 1  # off, on pairs
    seed: int = 17
    vocab: int = 1024  # the tiny model's; ids below 5 (special tokens) are never sent
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("workers", "heads", "head_tokens", "rounds", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    def prompts(self) -> list[tuple[int, list[int]]]:
        """(round, token ids) in sending order: every head once per round."""
        rng = random.Random(self.seed)
        heads = [[rng.randrange(5, self.vocab) for _ in range(self.head_tokens)] for _ in range(self.heads)]
        return [(r, h + [rng.randrange(5, self.vocab) for _ in range(self.tail_tokens + r)])
                for r in range(self.rounds) for h in heads]  # fmt: skip


@dataclass(frozen=True)
class Sample:
    round: int
    prompt_tokens: int
    cached_tokens: int
    loaded_tokens: int
    repaired_tokens: int
    replica: str
    ttft_s: float


@dataclass(frozen=True)
class SideResult:
    side: str  # "off" | "on"
    repeat: int
    deploy_s: float
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class TierABResult:
    settings: TierABSettings
    machine: MachineInfo
    sides: tuple[SideResult, ...]
    wall_s: float
    load_avg_after: float


# ---------------------------------------------------------------- running


def run_ab(s: TierABSettings) -> TierABResult:
    """Start Ray, run `off` then `on` `repeats` times, stop Ray (also on errors)."""
    t0 = time.perf_counter()
    machine = machine_info()
    with local_serve(s.num_cpus, MODEL) as url:
        out = [_one_side(s, side, repeat, url) for repeat in range(s.repeats) for side in SIDES]
    return TierABResult(s, machine, tuple(out), time.perf_counter() - t0, load_average())


def config(s: TierABSettings, side: str) -> ServeConfig:
    from deploy.config import ServeConfig

    share = round((s.num_cpus - 0.25) / s.workers - 0.005, 2)  # the ingress takes 0.25 CPU
    return ServeConfig.model_validate({
        "model": MODEL, "workers": s.workers, "worker_num_cpus": share, "seed": s.seed, **ENGINE,
        "host_kv_bytes": HOST_KV_BYTES if side == "on" else 0,
    })  # fmt: skip


def _one_side(s: TierABSettings, side: str, repeat: int, url: str) -> SideResult:
    import httpx

    with deployed(config(s, side), url, s.startup_timeout_s) as (deploy_s, headers):
        with httpx.Client(base_url=url, timeout=300, headers=headers) as http:
            counts, samples = _served_counts(http), []
            for r, ids in s.prompts():
                sample, counts = _send(http, r, ids, s.max_tokens, counts)
                samples.append(sample)
    return SideResult(side, repeat, deploy_s, tuple(samples))


SERVED_COUNTERS = ("swaserve_loaded_prompt_tokens_total", "swaserve_repaired_prompt_tokens_total")


def _served_counts(http: Any) -> tuple[int, int]:
    """(loaded, repaired) prompt tokens the ingress has counted so far (`/metrics`)."""
    resp = http.get("/metrics")
    if resp.status_code != 200:
        raise RuntimeError(f"/metrics answered {resp.status_code}: {resp.text[:300]!r}")
    values = dict.fromkeys(SERVED_COUNTERS, 0)
    for line in resp.text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = int(float(value))
    loaded, repaired = (values[n] for n in SERVED_COUNTERS)
    return loaded, repaired


def _send(
    http: Any, round_: int, ids: list[int], max_tokens: int, before: tuple[int, int]
) -> tuple[Sample, tuple[int, int]]:
    """One streamed completion: its usage, the time to its first text, and its loaded and
    repaired tokens (the counters' growth from `before`); returns the counters after it too."""
    import json

    from deploy.openai.headers import REPLICA_HEADER

    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, usage = None, None
    with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.read()[:300]!r}")
        h = resp.headers
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if usage is None or first is None:
        raise RuntimeError("the stream sent no text or no usage chunk")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    after = _served_counts(http)
    loaded, repaired = after[0] - before[0], after[1] - before[1]
    sample = Sample(round_, usage["prompt_tokens"], cached, loaded, repaired, h.get(REPLICA_HEADER, "?"),
                    first - t0)  # fmt: skip
    return sample, after


# ---------------------------------------------------------------- report


def _quantile(values: list[float], q: float) -> float:
    from bench.routing.figures import quantile

    return quantile(values, q)


def side_rows(r: TierABResult) -> list[list[str]]:
    """One row per side (repeats pooled): prefill, cached, loaded, repaired, TTFT."""
    rows = []
    for side in SIDES:
        runs = [x for x in r.sides if x.side == side]
        samples = [p for x in runs for p in x.samples]
        if not samples:
            continue
        prompt = sum(p.prompt_tokens for p in samples)
        cached = sum(p.cached_tokens for p in samples)
        ttft = [p.ttft_s * 1e3 for p in samples]
        again = [p.ttft_s * 1e3 for p in samples if p.round > 0]
        rows.append([
            side, str(len(samples)), f"{prompt:,}", f"{prompt - cached:,}", f"{cached / prompt:.3f}",
            f"{sum(p.loaded_tokens for p in samples):,}", f"{sum(p.repaired_tokens for p in samples):,}",
            f"{_quantile(ttft, 0.5):.0f}", f"{_quantile(ttft, 0.99):.0f}",
            f"{_quantile(again, 0.5):.0f}" if again else "-",
            " / ".join(f"{x.deploy_s:.0f}" for x in runs),
        ])  # fmt: skip
    return rows


def table(r: TierABResult) -> str:
    return markdown_table(
        ["host tier", "requests", "prompt tokens", "prefill tokens", "hit rate", "loaded tokens",
         "repaired tokens", "TTFT p50 ms", "TTFT p99 ms", "TTFT p50 ms, revisits", "deploy s"],
        side_rows(r),
    )  # fmt: skip


def summary(r: TierABResult) -> str:
    s = r.settings
    cfg = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in ENGINE.items())
    return "\n\n".join([
        "# Host tier on vs off, served (`swaserve bench tier-ab`)", (__doc__ or "").strip(),
        f"{s.workers} tiny workers on a local Ray cluster with {s.num_cpus} CPUs; {cfg}; host tier "
        f"{HOST_KV_BYTES // 1024**2} MiB (`on`) or 0 (`off`). Stream: {s.heads} heads of "
        f"{s.head_tokens} tokens x {s.rounds} rounds, {s.max_tokens} new tokens, seed {s.seed}; "
        f"{s.repeats} off/on pair(s).",
        f"Machine: {r.machine.describe()} (after: {r.load_avg_after:.2f}); whole run {r.wall_s:.0f} s.",
        table(r),
    ])  # fmt: skip


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TierABSettings()
    a = parser.add_argument
    a("--workers", type=int, default=d.workers)
    a("--num-cpus", type=int, default=d.num_cpus, help="CPUs of the local Ray cluster")
    a("--heads", type=int, default=d.heads, help="distinct prefixes revisited")
    a("--head-tokens", type=int, default=d.head_tokens)
    a("--rounds", type=int, default=d.rounds, help="visits of every head")
    a("--max-tokens", type=int, default=d.max_tokens)
    a("--repeats", type=int, default=d.repeats, help="off/on pairs, alternated")
    a("--seed", type=int, default=d.seed)
    add_output_arguments(parser, "bench_results/tier_ab")


def run(args: argparse.Namespace) -> int:
    try:
        s = TierABSettings(workers=args.workers, num_cpus=args.num_cpus, heads=args.heads,
                           head_tokens=args.head_tokens, rounds=args.rounds,
                           max_tokens=args.max_tokens, repeats=args.repeats, seed=args.seed)  # fmt: skip
    except ValueError as exc:
        print(f"swaserve bench tier-ab: {exc}", file=sys.stderr)
        return 2
    result = run_ab(s)
    out = prepare_output_dir(args.output_dir)
    write_json(out / "tier_ab.json", result)
    write_text(out / "summary.md", summary(result))
    print(table(result))
    print(f"tier-ab ({result.wall_s:.0f} s) -> {out}/tier_ab.json, summary.md")
    return 0

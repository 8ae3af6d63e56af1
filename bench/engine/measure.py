"""What `swaserve bench engine` measures: our engine's decode throughput against transformers'
`generate`, and how.

Same weights, same prompts (random ids, lengths `prompt_len // 2 … prompt_len`), greedy, exactly
`max_new_tokens` new tokens per prompt on both sides, float32, torch's default thread count
unless ``--threads`` says otherwise. Per batch size:

- both sides are warmed up on that batch (2 new tokens), then each is run `runs` times,
  alternating ours / transformers so that load changes hit both alike; the best run counts.
  Runs after the first are skipped once the batch size has used its share of
  `time_budget_s` (a busy machine can make each run minutes long);
- *tokens/s* = batch × max_new_tokens / wall seconds of the whole `generate` call (prefill
  included); *prefill* = the best wall time of the same call with one new token (TTFT-ish);
- *agree* = prompts whose greedy tokens are identical on both sides (batch 1 must agree; in a
  padded batch transformers' arithmetic differs by rounding, which can flip a near-tie);
- pool peaks = the engine's `stats().full/swa.peak_used` over that batch's runs (a fresh engine
  per batch size), next to the pool totals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.engine.model import ModelInfo, make_prompts, model_info, resolve_base, scaled_model
from bench.engine.sides import EngineSide, TransformersSide
from bench.harness import progress
from bench.machine import MachineInfo, load_average, machine_info


@dataclass(frozen=True)
class EngineSettings:
    model: str = "tiny"
    hidden: int | None = None  # a larger random model of the same architecture
    layers: int | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 64
    max_new_tokens: int = 32
    runs: int = 3
    time_budget_s: float = 200.0  # extra runs stop when a batch size exceeds its share
    hf_attn: str = "auto"  # auto: sdpa where the architecture supports it, else eager
    threads: int | None = None  # None: torch's default
    device: str = "cpu"


@dataclass(frozen=True)
class SideResult:
    wall_s: float  # best of `runs`
    all_wall_s: tuple[float, ...]
    tokens_per_s: float
    prefill_s: float  # best wall time of a 1-new-token generate


@dataclass(frozen=True)
class BatchResult:
    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    ours: SideResult
    transformers: SideResult
    speedup: float  # ours tokens/s over transformers'
    agree: int  # prompts with identical greedy tokens
    first_mismatch: int | None  # earliest differing token index over all prompts
    full_peak_used: int
    full_total: int
    swa_peak_used: int
    swa_total: int


@dataclass(frozen=True)
class EngineBenchResult:
    settings: EngineSettings
    machine: MachineInfo
    model: ModelInfo
    hf_attn_implementation: str
    batches: tuple[BatchResult, ...]
    load_avg_after: float


# ---------------------------------------------------------------- measurement


def _side(timings: list[float], prefill: list[float], tokens: int) -> SideResult:
    best = min(timings)
    return SideResult(best, tuple(timings), tokens / best, min(prefill))


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int | None]:
    agree, first = 0, None
    for x, y in zip(a, b):
        if x == y:
            agree += 1
            continue
        i = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        first = i if first is None else min(first, i)
    return agree, first


def measure_batch(
    prompts: list[list[int]], model_dir: Path, hf: TransformersSide, s: EngineSettings, deadline: float
) -> BatchResult:
    ours = EngineSide(model_dir, len(prompts), {"device": s.device})
    for side in (ours, hf):
        side.generate(prompts, 2)  # warm-up: lazy setup, allocator paths, first-call caches
    timings: dict[str, list[float]] = {"ours": [], "hf": [], "ours_pf": [], "hf_pf": []}
    last = {}
    for i in range(s.runs):
        if i and time.monotonic() > deadline:
            break
        for key, side in (("ours", ours), ("hf", hf)):
            run = side.generate(prompts, s.max_new_tokens)
            timings[key].append(run.seconds)
            last[key] = run.tokens
            timings[key + "_pf"].append(side.generate(prompts, 1).seconds)
    generated = len(prompts) * s.max_new_tokens
    mine, theirs = (_side(timings[k], timings[k + "_pf"], generated) for k in ("ours", "hf"))
    agree, first = _agreement(last["ours"], last["hf"])
    full_peak, full_total, swa_peak, swa_total = ours.pool_peaks()
    return BatchResult(
        batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)), generated_tokens=generated,
        ours=mine, transformers=theirs, speedup=mine.tokens_per_s / theirs.tokens_per_s,
        agree=agree, first_mismatch=first, full_peak_used=full_peak, full_total=full_total,
        swa_peak_used=swa_peak, swa_total=swa_total,
    )  # fmt: skip


def run_bench(s: EngineSettings, work_dir: Path) -> EngineBenchResult:
    """Prepare the model, then measure every batch size (one progress bar over them)."""
    import torch

    if s.threads is not None:
        torch.set_num_threads(s.threads)
    base = resolve_base(s.model)
    scaled = s.hidden is not None or s.layers is not None
    model_dir = scaled_model(base, s.hidden, s.layers, work_dir / "model") if scaled else base
    name = f"{s.model} (hidden {s.hidden or '-'}, layers {s.layers or '-'})" if scaled else s.model
    info = model_info(name, model_dir)
    machine = machine_info()
    hf = TransformersSide(model_dir, s.hf_attn, s.device)
    prompts = make_prompts(max(s.batch_sizes), s.prompt_len, info.vocab_size)
    start, share = time.monotonic(), s.time_budget_s / len(s.batch_sizes)
    batches = tuple(
        measure_batch(prompts[:b], model_dir, hf, s, start + share * (i + 1))
        for i, b in enumerate(progress(s.batch_sizes, desc="engine vs transformers"))
    )
    return EngineBenchResult(s, machine, info, hf.attn, batches, load_average())

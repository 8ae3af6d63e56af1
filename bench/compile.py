"""`swaserve bench compile`: offline `Engine.generate` throughput with `compile: off` against
`compile: auto` (and, on CPU, inductor with freezing, and inductor around auto's packed
linears), on the random 46M Gemma-3 of `bench.compare.model`.

Decode-heavy by default: random 256-token prompts, 64 new tokens (greedy, ignore_eos), one torch
thread. Every mode's engine is built first (compile and warm-up time reported), then each batch
size is run `runs` times per mode, the modes alternating so that load changes hit all alike; the
best run counts. Ratios are against `off` in the same process; greedy tokens must be identical.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    add_output_arguments,
    markdown_table,
    prepare_output_dir,
    write_json,
    write_text,
)
from bench.machine import load_average

# packed: auto without its compile (packed linears, eager); inductor: inductor + freezing of the
# unpacked model; gather: auto's engine with the CPU attention kernel off (the torch
# backend's gather path, docs §21; the same engine, since two compiled engines cannot share a
# process). Measurements, not configs.
MODES = ("off", "auto", "packed", "inductor", "gather")


@dataclass(frozen=True)
class ModeRow:
    mode: str
    batch_size: int
    tokens_per_s: float
    ratio: float  # over `off`
    same_tokens: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", help="a local HF directory (default: the 46M Gemma-3)")
    add_output_arguments(parser, "bench_results/compile")


def _engine(model_dir: Path, mode: str, tokens: int) -> tuple[Any, float]:
    import worker.models.compiled as compiled
    from worker.config import EngineConfig
    from worker.engine.engine import Engine

    # NOTE: a measurement switch, not a config: `auto` leaves CPU inductor out (docs §19).
    compiled.CPU_INDUCTOR = mode == "inductor"
    compiled.CPU_PACK_ONLY = mode == "packed"
    t0 = time.perf_counter()
    try:
        config = EngineConfig(
            model=str(model_dir), compile="off" if mode == "off" else "auto",
            max_total_tokens=tokens, max_running_requests=256,
        )  # fmt: skip
        engine = Engine(config)
    finally:
        compiled.CPU_INDUCTOR = compiled.CPU_PACK_ONLY = False
    return engine, time.perf_counter() - t0


def _generate(engine: Any, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    from core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert engine.flush_cache(), "engine busy after generate"
    return seconds, [list(o.token_ids) for o in outs]


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.compare.model import ensure_compare_model

    torch.set_num_threads(args.threads)
    out_dir = prepare_output_dir(args.output_dir)
    model_dir = Path(args.model) if args.model else ensure_compare_model()
    need = max(args.batch_sizes) * (args.prompt_len + args.max_new_tokens + 64)  # + page rounding
    load_before = load_average()
    engines: dict[str, Any] = {}
    build_s: dict[str, float] = {}
    for mode in args.modes:
        other = {"gather": "auto", "auto": "gather"}.get(mode)
        if other in engines:
            engines[mode], build_s[mode] = engines[other], 0.0
            continue
        engines[mode], build_s[mode] = _engine(model_dir, "auto" if mode == "gather" else mode, need)
        print(f"{mode}: engine built (load, prepare, warm-up) in {build_s[mode]:.1f} s", flush=True)
    shared = engines.get("auto") or engines.get("gather")  # one engine, its kernel switched
    kernels = {"auto": shared.runner.backend.kernel, "gather": None} if shared else {}

    def _run(mode: str, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
        e = engines[mode]
        if mode in kernels:
            e.runner.backend.kernel = kernels[mode]
        return _generate(e, prompts, max_new)

    gen = torch.Generator().manual_seed(0)
    rows: list[ModeRow] = []
    for b in args.batch_sizes:
        prompts = torch.randint(1, 1000, (b, args.prompt_len), generator=gen).tolist()
        for mode in engines:  # warm each mode on this batch (2 tokens)
            _run(mode, prompts, 2)
        best = dict.fromkeys(args.modes, float("inf"))
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.runs):
            for mode in engines:
                seconds, tokens[mode] = _run(mode, prompts, args.max_new_tokens)
                best[mode] = min(best[mode], seconds)
        base = b * args.max_new_tokens / best[args.modes[0]]
        for mode in args.modes:
            tps = b * args.max_new_tokens / best[mode]
            rows.append(ModeRow(mode, b, tps, tps / base, tokens[mode] == tokens[args.modes[0]]))
            print(f"batch {b:3d} {mode:9s} {tps:8.1f} tok/s  x{tps / base:.2f}", flush=True)
    table = markdown_table(
        ["batch", "mode", "tokens/s", f"ratio vs {args.modes[0]}", "same greedy tokens"],
        [
            (r.batch_size, r.mode, f"{r.tokens_per_s:.1f}", f"{r.ratio:.2f}", r.same_tokens)
            for r in rows
        ],
    )
    note = (f"load average (1 min) before {load_before:.2f}, after {load_average():.2f}; build s: "
            + ", ".join(f"{m} {s:.1f}" for m, s in build_s.items()))  # fmt: skip
    print(table + "\n" + note)
    write_text(out_dir / "compile.md", table + "\n\n" + note + "\n")
    write_json(out_dir / "compile.json", {"rows": rows, "build_s": build_s, "args": vars(args)})
    return 0 if all(r.same_tokens for r in rows) else 1

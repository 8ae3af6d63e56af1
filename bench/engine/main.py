"""`swaserve bench engine`: our engine's decode throughput against transformers' `generate`.

Same weights and prompts on both sides, per batch size (`measure.py` says how); output in
--output-dir: `engine.json`, `summary.md` and `engine_tokens_per_s.png` (`report.py`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.engine.measure import EngineSettings, run_bench
from bench.engine.report import write_plot, write_summary
from bench.harness import add_output_arguments, prepare_output_dir, write_json, write_text
from worker.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineSettings()
    parser.add_argument(
        "--model", default=d.model, help="'tiny' (default) or a local HF model directory"
    )
    parser.add_argument(
        "--hidden", type=int, help="build a random model of this width with the same architecture"
    )
    parser.add_argument("--layers", type=int, help="... and this many layers (layer pattern tiled)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=list(d.batch_sizes))
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=d.prompt_len,
        help="longest prompt (tokens); lengths vary down to half",
    )
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument(
        "--runs",
        type=int,
        default=d.runs,
        help="timed runs per side and batch size; the best counts",
    )
    parser.add_argument(
        "--hf-attn",
        default=d.hf_attn,
        choices=("auto", "eager", "sdpa"),
        help="transformers attention",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads for both sides (default: torch's default)"
    )
    parser.add_argument("--device", default=d.device, help="cpu (default) or cuda")
    parser.add_argument(
        "--time-budget", type=float, default=d.time_budget_s,
        help="seconds after which extra runs are skipped (each batch size gets its share; "
        "at least one timed run always happens)",
    )  # fmt: skip
    add_output_arguments(parser, "bench_results/engine")  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    for name in ("runs", "prompt_len", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        raise ValueError("--batch-sizes must all be >= 1")
    return EngineSettings(
        model=args.model, hidden=args.hidden, layers=args.layers,
        batch_sizes=tuple(args.batch_sizes), prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens, runs=args.runs, hf_attn=args.hf_attn,
        threads=args.threads, device=args.device, time_budget_s=args.time_budget,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        with tempfile.TemporaryDirectory(prefix="swaserve-bench-engine-") as tmp:
            result = run_bench(settings, Path(tmp))
    except (ConfigError, ValueError) as exc:
        print(f"swaserve bench engine: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    write_json(out / "engine.json", result)
    write_text(out / "summary.md", write_summary(result))
    if not args.no_plots:
        write_plot(result, out / "engine_tokens_per_s.png")
    for b in result.batches:
        print(f"batch {b.batch_size:>3}: ours {b.ours.tokens_per_s:8.1f} tok/s, transformers "
              f"{b.transformers.tokens_per_s:8.1f} tok/s ({b.speedup:.2f}x), agree {b.agree}/{b.batch_size}")  # fmt: skip
    print(f"engine bench -> {out}/engine.json, summary.md")
    return 0

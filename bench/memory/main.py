"""`swaserve bench memory`: what the dual pools buy, from real model configs, without a GPU.

For each model config and KV budget: the dual pools across `swa_full_tokens_ratio` and one pool,
and the concurrent requests each admits per context length (`admission.py` says how they are
counted). Output in --output-dir: `memory.json`, `summary.md` and PNG plots (`report.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.configs import CONFIG_DIR
from bench.harness import add_output_arguments, prepare_output_dir, progress, write_json, write_text
from bench.memory.admission import MemorySettings, evaluate_model
from bench.memory.report import write_plots, write_summary
from worker.errors import ConfigError
from worker.models.hf_config import load_spec

DEFAULT_MODELS = ("gpt-oss-120b", "gpt-oss-20b", "mimo-v2-flash", "gemma-3-27b-it")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MemorySettings()
    parser.add_argument(
        "--models", nargs="+", default=list(DEFAULT_MODELS),
        help="shipped config names (bench/configs/<name>.json) or paths to a config.json / "
        f"model directory (default: {' '.join(DEFAULT_MODELS)})",
    )  # fmt: skip
    parser.add_argument("--budgets-gib", nargs="+", type=float, default=list(d.budgets_gib))
    parser.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=list(d.ratios),
        help="swa_full_tokens_ratio values",
    )
    parser.add_argument(
        "--contexts", nargs="+", type=int, default=list(d.contexts), help="context lengths (tokens)"
    )
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument(
        "--dtype-bytes", type=int, default=d.dtype_bytes, help="KV element size (2 = bf16)"
    )
    parser.add_argument("--swa-eviction-interval", type=int, default=d.swa_eviction_interval)
    add_output_arguments(parser, "bench_results/memory")


def run(args: argparse.Namespace) -> int:
    settings = MemorySettings(
        tuple(args.budgets_gib), tuple(args.ratios), tuple(args.contexts),
        args.page_size, args.dtype_bytes, args.swa_eviction_interval,
    )  # fmt: skip
    try:
        specs = [(_model_name(m), load_spec(_config_path(m))) for m in args.models]
        results = [
            evaluate_model(n, sp, settings) for n, sp in progress(specs, desc="memory plans")
        ]
    except ConfigError as exc:
        print(f"swaserve bench memory: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    write_json(out / "memory.json", {"settings": settings, "models": results})
    write_text(out / "summary.md", write_summary(results, settings))
    if not args.no_plots:
        write_plots(results, settings, out)
    print(f"memory bench: {len(results)} model(s) -> {out}/memory.json, summary.md")
    return 0


def _config_path(model: str) -> Path:
    shipped = CONFIG_DIR / f"{model}.json"
    return shipped if shipped.is_file() else Path(model)


def _model_name(model: str) -> str:
    path = Path(model)
    if path.name == "config.json":
        return path.parent.name
    return path.stem if path.suffix == ".json" else path.name

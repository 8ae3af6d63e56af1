"""`swaserve bench BENCHMARK [options]`: the benchmarks by name, each imported only when it runs.

A benchmark is a module with

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int          # exit status

`BENCHMARKS` maps the name on the command line to that module. Importing only the one asked for
keeps `swaserve bench --help` light (benchmarks pull in torch, Ray, matplotlib) and lets a
benchmark whose own dependency is missing break only itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

BENCHMARKS = {
    "memory": "bench.memory.main",
    "engine": "bench.engine.main",
    "cache": "bench.cache",
    "routing": "bench.routing.main",
    "index-ingest": "bench.index_ingest",
    "index-actor": "bench.index_actor",
    "vllm-compare": "bench.compare.vllm_compare",
    "cluster-compare": "bench.compare.cluster_compare",
    "replica-profile": "bench.compare.replica_profile",
    "serving-ceiling": "bench.compare.serving_ceiling",
    "host-step": "bench.host_step",
    "gpu-check": "bench.gpu_check",
    "schedule": "bench.schedule",
    "compile": "bench.compile",
    "linears": "bench.linears",
    "tier-ab": "bench.tier_ab",
}


def main(argv: Sequence[str]) -> int:
    """List the benchmarks (no name, or --help), or run one with its own options."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: swaserve bench BENCHMARK [options]\n\nbenchmarks: {', '.join(BENCHMARKS)}\n"
              "'swaserve bench BENCHMARK --help' shows a benchmark's options.")  # fmt: skip
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    if name not in BENCHMARKS:
        print(f"swaserve bench: unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = _load(name)
    if module is None:
        return 2
    parser = argparse.ArgumentParser(prog=f"swaserve bench {name}", description=(module.__doc__ or "").split("\n")[0])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


def _load(name: str) -> ModuleType | None:
    path = BENCHMARKS[name]
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is None or not (path == e.name or path.startswith(e.name + ".")):
            raise  # the benchmark exists but one of its own imports is missing: show that
        print(f"swaserve bench: benchmark {name!r} is not available in this install "
              f"(no module {path})", file=sys.stderr)  # fmt: skip
        return None

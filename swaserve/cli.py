"""`swaserve`: the command line (docs/design.md §3, §4.2).

    swaserve serve [flags]               the OpenAI API on a local Ray cluster (`deploy.cli`)
    swaserve bench BENCHMARK [options]   one benchmark (`bench.cli`)

NOTE: this module sits above both `bench` and `deploy` (the top layer of the import contract), so
both arrows point down and import-linter sees them; `deploy` never reaches `bench`. `bench` is
imported only when the command is `bench`: `swaserve serve` never loads it, and the serving
image, which leaves `bench/` out, answers `swaserve bench` with a clear error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.cli import DESCRIPTION, add_serve_command, run_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swaserve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_command(sub)
    # `bench` is dispatched before parsing (each benchmark has its own parser); listed for --help.
    sub.add_parser("bench", help="run a benchmark ('swaserve bench' lists them)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    return run_serve(build_parser().parse_args(argv))


def _bench(argv: list[str]) -> int:
    try:
        from bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name not in ("bench", "bench.cli"):
            raise  # bench is here but broken: show that
        print("swaserve bench: the benchmarks are not part of this install "
              "(the serving image leaves bench/ out)", file=sys.stderr)  # fmt: skip
        return 2
    return bench_main(argv)

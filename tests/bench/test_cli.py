"""`bench.cli`'s registry: every benchmark it names exists and builds its own parser."""

from __future__ import annotations

import argparse
import importlib

import pytest

from bench.cli import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_registered_benchmark_builds_its_parser(name: str) -> None:
    """The module a name points at imports and has `add_arguments` and `run`."""
    module = importlib.import_module(BENCHMARKS[name])
    parser = argparse.ArgumentParser(prog=f"swaserve bench {name}")
    module.add_arguments(parser)
    assert callable(module.run)
    assert parser.format_help().startswith(f"usage: swaserve bench {name}")

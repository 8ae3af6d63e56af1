"""The `swaserve` command: `serve` from deploy, `bench` from bench, each reached only when asked."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest

from swaserve import cli

REPO = Path(__file__).resolve().parents[2]


def test_bench_dispatches_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    """`swaserve bench NAME ARGS` imports the benchmark's module and runs it with its own options."""
    seen: dict[str, object] = {}
    fake = types.ModuleType("bench.routing.main")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--requests", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        seen["requests"] = args.requests
        return 3

    fake.add_arguments, fake.run = add_arguments, run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.routing.main", fake)
    assert cli.main(["bench", "routing", "--requests", "7"]) == 3
    assert seen == {"requests": 7}
    monkeypatch.setitem(sys.modules, "bench.compare.vllm_compare", fake)  # a hyphenated name's module
    assert cli.main(["bench", "vllm-compare", "--requests", "2"]) == 3 and seen == {"requests": 2}


def test_bench_missing_or_unknown_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown benchmark or a missing module exits 2 with a message naming it."""
    assert cli.main(["bench", "nonsense"]) == 2
    assert "unknown benchmark 'nonsense'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "bench.cache", None)  # import now fails like a missing file
    assert cli.main(["bench", "cache"]) == 2
    assert "not available" in capsys.readouterr().err


def test_an_install_without_bench_serves_and_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without bench/ (the serving image) `swaserve bench` exits 2 saying so, and parsing
    `swaserve serve` in a fresh interpreter loads no bench module."""
    monkeypatch.setitem(sys.modules, "bench.cli", None)
    assert cli.main(["bench", "routing"]) == 2
    assert "not part of this install" in capsys.readouterr().err
    code = ("import sys; from swaserve.cli import build_parser; build_parser().parse_args(['serve']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_bench_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    """`swaserve bench --help` lists every benchmark (exit 0); `swaserve bench` alone exits 2."""
    assert cli.main(["bench", "--help"]) == 0
    assert "routing" in capsys.readouterr().out
    assert cli.main(["bench"]) == 2

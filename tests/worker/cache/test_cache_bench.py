"""Smoke test of `swaserve bench cache` on a tiny tree (the real run is not part of the suite)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import cache as bench


def test_bench_cache_writes_rates(tmp_path: Path) -> None:
    """Every operation is timed at every size and lands in cache.json and summary.md."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--pages", "800", "1600", "--page-size", "4", "--window", "7", "--seq-pages", "16",
         "--ops", "20", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert bench.run(args) == 0
    data = json.loads((tmp_path / "cache.json").read_text())
    ops = [(r["op"], r["ops"] > 0, r["ops_per_s"] > 0) for r in data["rates"]]
    assert [o for o, *_ in ops] == ["insert", "match", "evict_swa", "evict_full"] * 2
    assert all(ok and fast for _, ok, fast in ops)
    assert data["rates"][5]["tree_pages"] > data["rates"][1]["tree_pages"]
    assert "| match |" in (tmp_path / "summary.md").read_text()

"""`swaserve bench host-step` runs end to end on a small layer plan (its timing is not checked):
the paged path sends one page-table entry per decoding request, the flat path every key."""

from __future__ import annotations

import argparse

from bench import host_step
from bench.host_step import HostStepSettings, measure, report, run_cells
from bench.sim_runner import sim_spec


def test_cells_and_the_entries_each_path_sends() -> None:
    s = HostStepSettings(batches=(1, 3), contexts=(64, 160), steps=3, warmup=1)
    spec = sim_spec(window=16, vocab_size=512)
    cells = run_cells(spec, s)
    assert [(c.path, c.batch, c.context) for c in cells] == [
        (p, b, c) for b in s.batches for c in s.contexts for p in s.paths
    ]
    for c in cells:
        assert c.step_us > 0 and c.wall_us > 0 and 0 <= c.runner_us
        if c.path == "paged":
            assert c.full_view_entries == c.batch  # one new entry per decode, whatever the context
        else:  # every request's whole table: context + the tokens decoded so far
            assert c.full_view_entries >= c.batch * c.context
    table = report(cells, s)
    assert table.count("\n") == 1 + len(s.paths) * len(s.batches)  # header, rule, one row each
    assert "64→160" in table


def test_cli_arguments_parse() -> None:
    parser = argparse.ArgumentParser()
    host_step.add_arguments(parser)
    args = parser.parse_args(["--batches", "2", "--contexts", "32", "--steps", "2", "--paths", "paged"])
    assert args.batches == [2] and args.paths == ["paged"] and args.threads == 1
    cell = measure(sim_spec(window=8, vocab_size=64), 2, 32, HostStepSettings(steps=2, warmup=1), "paged")
    assert cell.full_view_entries == 2

"""The model presets of `swaserve bench routing` on tiny traffic: real layer plans, pools from
`plan_pools`, the three stacks (host tiers on two of them), token-layers, capacity, the report
and the trade-off plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.stacks import (
    POOLS,
    ROOMY,
    STACK_NAMES,
    StackJob,
    StackSettings,
    capacity,
    distinct_tokens,
    pool_tokens,
    preset_spec,
    run_stack_job,
)
from bench.routing.stacks_report import stacks_table, target_rows, write_tradeoff_plot


def test_presets_have_the_real_layer_plans() -> None:
    """GPT-OSS-120B: 36 layers, 18 SWA, window 127; MiMo-V2-Flash: 48 layers, 39 SWA, 128."""
    for name, layers, swa, window in (("gpt-oss-120b", 36, 18, 127), ("mimo-v2-flash", 48, 39, 128)):
        spec = preset_spec(name)
        assert (spec.num_layers, len(spec.swa_layer_ids), spec.window) == (layers, swa, window)


def test_pools_and_capacity_follow_the_ratio() -> None:
    """Smaller ratios: bigger full pools, smaller SWA pools, more concurrent requests; roomy is
    the ratio-0.1 full pool with an SWA pool as large."""
    spec, s = preset_spec("gpt-oss-120b"), StackSettings()
    budget = s.budget_bytes("multi_tenant")
    pools = {p: pool_tokens(spec, budget, p, 16) for p in POOLS}
    assert pools["r0.05"][0] > pools["r0.1"][0] > pools["r0.25"][0]
    assert pools["r0.05"][1] < pools["r0.1"][1] < pools["r0.25"][1]
    assert pools[ROOMY] == (pools["r0.1"][0], pools["r0.1"][0])
    caps = [capacity(spec, p, s) for p in ("r0.05", "r0.1", "r0.25", ROOMY)]
    assert caps == sorted(caps, reverse=True) and caps[-1] > 0


def test_distinct_tokens_counts_a_trie() -> None:
    assert distinct_tokens([(1, 2, 3), (1, 2, 4), (1, 2), (5,), (1, 2, 3)]) == 5


@pytest.mark.slow
def test_the_stacks_run_and_report(tmp_path: Path) -> None:
    """multi_tenant on GPT-OSS-120B at ratio 0.1 and roomy: every run finishes; at ratio 0.1
    the two tiered stacks have a host tier of 4x the device budget and load from it, none on
    the roomy pool; swaserve's quiet predictions are exact; the tables and the PNG are written."""
    s = StackSettings(models=("gpt-oss-120b",), workloads=("multi_tenant",), requests_per_worker=20)
    runs = [run_stack_job(s, StackJob("gpt-oss-120b", "multi_tenant", pool, stack))
            for pool in ("r0.1", ROOMY) for stack in STACK_NAMES]  # fmt: skip
    for r in runs:
        assert r.token_layers == r.figures.prefill_tokens * 36 > 0 and r.fill > 0
        tiered = r.pool == "r0.1" and r.stack != "sglang_like"
        assert (r.host_full_tokens > 0) == tiered == (r.figures.offloaded_tokens > 0)
        if tiered:  # 4x the device budget, its SWA tokens as many as its full ones
            host_bytes = (r.host_full_tokens + r.host_swa_tokens) * 36_864
            assert r.host_swa_tokens == r.host_full_tokens
            assert 3.9 * s.budget_bytes("multi_tenant") < host_bytes <= 4 * s.budget_bytes("multi_tenant")
            assert r.figures.loaded_tokens > 0
        if r.stack == "swaserve":  # decisions on an idle worker saw its cache: exact
            assert r.figures.quiet_exact == r.figures.quiet_decisions > 0
    assert [row[1] for row in target_rows(runs)] == ["multi_tenant"]
    table = stacks_table(runs)
    assert "| gpt-oss-120b | multi_tenant | r0.1 |" in table and "| gpt-oss-120b | multi_tenant | roomy |" in table
    assert write_tradeoff_plot(runs, tmp_path).read_bytes()[:4] == b"\x89PNG"

"""`swaserve bench routing` on tiny settings: the simulator's plumbing, the files, and the targets
(swa_prefix's predictions are exact; it computes no more prefill than prefix under SWA pressure
and exactly as much without)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.routing import main as routing
from bench.routing.figures import quantile
from bench.routing.sim import SimCluster, Simulation
from bench.routing.workloads import WorkloadSize, make_workload
from bench.sim_runner import SIM_TOKEN, SimRunner, StepCost, build_sim_engine, sim_spec
from core.sampling_params import SamplingParams
from worker.runner.forward_batch import ForwardBatch, ForwardReq
from worker.runner.sampler import SampleRow

WORKERS, PER_WORKER = 4, 12  # small, but enough traffic for tombstones to change placements


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- pieces


def test_sim_runner_counts_prefill_and_decode_and_samples_its_token() -> None:
    """A multi-token row is prefill, a one-token row after a prefix a decode; every row samples 1."""
    table = torch.arange(64)
    batch = ForwardBatch((ForwardReq([5] * 20, 0, table), ForwardReq([7], 30, table),
                          ForwardReq([9] * 8, 4, table, need_logits=False)))  # fmt: skip
    runner = SimRunner()
    logits = runner.forward(batch).logits
    assert (runner.last_prefill_tokens, runner.last_decode_tokens, logits.shape[0]) == (28, 1, 2)
    out = runner.sample(logits, [SampleRow(SamplingParams(), key=0, step=0)] * 2)
    assert out.token_ids == [SIM_TOKEN, SIM_TOKEN] and runner.fed_tokens == 29


def test_step_cost_is_affine_in_tokens_and_loaded_bytes() -> None:
    """overhead + per prefill token + per decode row + loaded bytes over the link; the tier
    costs the engine prices with are the same prices."""
    c = StepCost(overhead_s=0.01, prefill_token_s=0.001, decode_token_s=0.002, link_gbps=2.0)
    assert c.seconds(100, 3) == pytest.approx(0.01 + 0.1 + 0.006)
    assert c.seconds(100, 3, 4_000_000_000) == pytest.approx(0.116 + 2.0)
    spec = sim_spec(128)  # 2 full and 6 SWA layers of 2 KV heads x 64 x (K, V) x 2 bytes
    costs = c.tier_costs(spec, 2)
    assert (costs.prefill, costs.load_full, costs.load_swa) == (0.001, 1024 / 2e9, 3072 / 2e9)


def test_sim_engine_offloads_to_its_host_tier_and_loads_back() -> None:
    """A sim engine with a host tier: prompts that push the first one off the device offload
    it; revisiting it loads its KV back (cached and loaded tokens, bytes for the clock)."""
    cluster = SimCluster(workers=1, full_tokens=1024, swa_ratio=0.5, chunked_prefill_size=128,
                         host_kv_bytes=8 * 1024**2)  # fmt: skip
    engine, _ = build_sim_engine(cluster.engine_config(), cluster.window, cost=cluster.cost)
    assert engine.tier_costs == cluster.cost.tier_costs(engine.spec, 2)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1000 * i + 2, 1000 * i + 402)) for i in range(4)]
    for p in prompts:
        engine.generate([p], params)
        engine.check_integrity()
    again = engine.generate([prompts[0] + [3]], params)[0]
    engine.check_integrity()
    stats = engine.stats()
    assert stats.offloaded_tokens > 0 and again.loaded_tokens > 0
    assert again.cached_tokens == 400 // 16 * 16 and stats.loaded_bytes > 0


def test_sim_engine_generates_to_max_tokens_and_reuses_its_cache() -> None:
    """The real engine around the SimRunner: exact lengths, a prefix hit on the second prompt."""
    cluster = SimCluster(workers=1, full_tokens=4096, chunked_prefill_size=64)
    engine, _ = build_sim_engine(cluster.engine_config(), cluster.window)
    prompt = list(range(2, 402))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first, second = engine.generate([prompt], params)[0], engine.generate([prompt + [3]], params)[0]
    assert first.token_ids == [SIM_TOKEN] * 5 and first.cached_tokens == 0
    assert second.cached_tokens == 400 // 16 * 16  # the chunk-inserted prompt is live
    engine.check_integrity()


def test_workload_follow_ups_do_not_depend_on_finish_order() -> None:
    """Closed loops give every policy the same follow-up content and think time."""
    size = WorkloadSize(workers=2, requests_per_worker=4, seed=3)
    a, b = make_workload("multi_turn", size), make_workload("multi_turn", size)
    first_a, first_b = a.initial(), b.initial()
    assert first_a == first_b
    x, y = first_a[0], first_a[1]
    ax, ay = a.follow_up(x, [1, 1], 5.0), a.follow_up(y, [1, 1], 6.0)
    by, bx = b.follow_up(y, [1, 1], 6.0), b.follow_up(x, [1, 1], 5.0)
    assert (ax.tokens, ax.arrival_s) == (bx.tokens, bx.arrival_s)  # type: ignore[union-attr]
    assert ay.tokens == by.tokens and ax.tokens[: len(x.tokens) + 2] == x.tokens + (1, 1)  # type: ignore[union-attr]


def test_quantile_nearest_rank() -> None:
    """p50 and p99 of 1..100 are 50 and 99."""
    values = list(range(1, 101))
    assert (quantile(values, 0.5), quantile(values, 0.99), quantile([7.0], 0.99)) == (50, 99, 7.0)


def test_index_mirrors_every_worker_cache_after_a_run() -> None:
    """Events drained per step and applied per worker rebuild each engine's cache exactly."""
    size = WorkloadSize(workers=3, requests_per_worker=6)
    sim = Simulation(SimCluster(workers=3, swa_ratio=0.06), "swa_prefix", make_workload("agent_branching", size))
    outcome = sim.run()
    assert outcome.tombstone_pages > 0, "the SWA pool was meant to be under pressure"
    for w in sim.workers.values():
        assert sim.index.snapshot(w.wid).pages == w.engine.cache_snapshot()  # type: ignore[union-attr]


def test_host_tier_runs_mirror_both_tiers_and_price_loads() -> None:
    """With host tiers (swaserve's stack): the index mirrors every page's tier, loads happen
    and are predicted, and the clock charged them (a run without tiers computes more)."""
    size = WorkloadSize(workers=2, requests_per_worker=10)
    cluster = SimCluster(workers=2, full_tokens=8192, swa_ratio=0.1, host_kv_bytes=32 * 1024**2)
    sim = Simulation(cluster, "swa_prefix", make_workload("multi_tenant", size))
    outcome = sim.run()
    assert outcome.loads > 0 and outcome.loaded_full_tokens + outcome.loaded_swa_tokens > 0
    assert outcome.offloaded_tokens > 0 and sim.host_tokens()[0] > 0
    for w in sim.workers.values():
        assert sim.index.snapshot(w.wid).pages == w.engine.cache_snapshot()  # type: ignore[union-attr]
    quiet = [t for t in outcome.tracks if t.quiet]
    assert all((t.predicted, t.predicted_loaded) == (t.cached, t.loaded) for t in quiet)
    assert any(t.loaded for t in quiet)
    plain = Simulation(replace(cluster, host_kv_bytes=0), "swa_prefix", make_workload("multi_tenant", size))
    assert plain.run().prefill_tokens > outcome.prefill_tokens


# ---------------------------------------------------------------- the subcommand


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "routing"
    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    args = parser.parse_args([
        "--output-dir", str(out), "--workers", str(WORKERS), "--requests-per-worker",
        str(PER_WORKER), "--workloads", "multi_turn", "agent_branching", "--pools",
        "swa_pressure", "single_pool", "--latency-workers", "6", "--latency-requests-per-worker",
        "2", "--jobs", "1", "--models",
    ])  # fmt: skip
    code = routing.run(args)
    data = json.loads((out / "routing.json").read_text()) if code == 0 else {}
    return code, out, data


def _runs(data: dict[str, Any], pool: str, policy: str) -> list[dict[str, Any]]:
    return [r for r in data["runs"] if r["pool"] == pool and r["policy"] == policy]


@pytest.mark.slow
def test_writes_json_markdown_and_plots(bench: tuple[int, Path, dict[str, Any]]) -> None:
    """Exit 0; routing.json with every (workload, pool, policy), summary.md, two real PNGs."""
    code, out, data = bench
    assert code == 0
    for name in ("routing_prefill.png", "routing_ttft.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    keys = {(r["workload"], r["pool"], r["policy"]) for r in data["runs"]}
    assert len(keys) == len(data["runs"]) == 2 * 2 * 4
    assert {r["workers"] for r in data["latency_runs"]} == {6} and len(data["latency_runs"]) == 4
    md = (out / "summary.md").read_text()
    assert "## Targets" in md and "## agent_branching" in md
    assert "| multi_turn | single_pool |" in md and "| equal | met |" in md


@pytest.mark.slow
def test_swa_prefix_predictions_are_exact(bench: tuple[int, Path, dict[str, Any]]) -> None:
    """Whenever the index equalled the worker's cache, swa_prefix predicted its cached tokens
    exactly; prefix credited tombstoned prefixes the worker could not reuse."""
    _, _, data = bench
    for r in _runs(data, "swa_pressure", "swa_prefix") + _runs(data, "single_pool", "swa_prefix"):
        assert r["quiet_decisions"] > 0 and r["quiet_exact"] == r["quiet_decisions"], r
        assert r["predictions_over"] == 0
    assert sum(r["predictions_over"] for r in _runs(data, "swa_pressure", "prefix")) > 0


@pytest.mark.slow
def test_swa_prefix_computes_no_more_prefill_than_prefix(
    bench: tuple[int, Path, dict[str, Any]],
) -> None:
    """Under SWA pressure swa_prefix <= prefix per workload (fewer in total); with one pool equal."""
    _, _, data = bench
    ours = {r["workload"]: r["prefill_tokens"] for r in _runs(data, "swa_pressure", "swa_prefix")}
    theirs = {r["workload"]: r["prefill_tokens"] for r in _runs(data, "swa_pressure", "prefix")}
    assert all(ours[w] <= theirs[w] for w in ours) and sum(ours.values()) < sum(theirs.values())
    single = {
        (r["workload"], r["policy"]): r["prefill_tokens"] for r in data["runs"]
        if r["pool"] == "single_pool"
    }  # fmt: skip
    for w in ours:
        assert single[(w, "swa_prefix")] == single[(w, "prefix")]


@pytest.mark.slow
def test_figures_are_consistent(bench: tuple[int, Path, dict[str, Any]]) -> None:
    """Runner-counted prefill = prompt − cached (no retractions); rates and quantiles in range."""
    _, _, data = bench
    for r in data["runs"]:
        assert r["retractions"] == 0
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert r["hit_rate"] == pytest.approx(r["cached_tokens"] / r["prompt_tokens"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["throughput_tok_s"] > 0
        assert (
            r["predictions_exact"] + r["predictions_over"] + r["predictions_under"] == r["requests"]
        )
        if r["pool"] == "single_pool":
            assert r["tombstone_pages"] == 0
    cache_blind = [r for r in data["runs"] if r["policy"] in ("least_loaded", "round_robin")]
    aware = [r for r in data["runs"] if r["policy"] in ("swa_prefix", "prefix")]
    assert max(r["hit_rate"] for r in cache_blind) < min(r["hit_rate"] for r in aware)

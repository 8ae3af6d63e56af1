"""`swaserve bench cluster-compare`: streams, counters, load, tables without servers; then its
smallest configuration against two `swaserve serve` replicas (ray), and against the peer too
when asked (SWASERVE_BENCH_PEER=1 and the Ray Serve LLM venv built)."""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.compare import cluster_compare
from bench.compare.cluster_report import (
    ClusterRun,
    cells,
    plot,
    run_record,
    runs_table,
    summary_table,
)
from bench.compare.cluster_stacks import (
    OURS,
    PEER,
    PEER_SHORT,
    Counters,
    StackConfig,
    ours_config,
    parse_counters,
    peer_spec,
)
from bench.compare.foreign_load import ForeignLoad, LoadProbe, machine_busy_seconds
from bench.compare.model import CompareModelShape, ensure_compare_model
from bench.compare.peers import RAY_SERVE_LLM, is_complete, peer_venv
from bench.compare.stream_client import RequestResult, StreamRun
from bench.compare.streams import (
    STREAM_WORKLOADS,
    StreamRequest,
    TextCodec,
    TextStream,
    distinct_tokens,
    estimate_distinct,
    make_workload,
    replay_offline,
    size_stream,
)

SMALL = CompareModelShape(hidden=64, layers=6, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                          sliding_window=16, max_positions=4096)  # fmt: skip


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_compare_model(tmp_path_factory.mktemp("cache"), SMALL)


@pytest.fixture(scope="module")
def codec(small_model: Path) -> TextCodec:
    return TextCodec.load(small_model)


def _answer(codec: TextCodec) -> Callable[[StreamRequest], str]:
    return lambda r: codec.text(random.Random(r.rid).randrange(2, 999) for _ in range(r.sim.max_tokens))


@pytest.mark.parametrize("name", STREAM_WORKLOADS)
def test_streams_keep_prefixes_in_text_and_fit_the_context(name: str, codec: TextCodec) -> None:
    """Every follow-up's text extends its parent's by the answer; prompts fit 4,096 positions."""
    stream = TextStream(make_workload(name, 2, 0, 2), codec)
    reqs = replay_offline(stream, _answer(codec))
    assert reqs and len({r.rid for r in reqs}) == len(reqs)
    text = {(r.sim.session, r.sim.step): r.text for r in reqs}
    for (session, step), t in text.items():
        assert step == 0 or t.startswith(text[(session, step - 1)])
    lengths = [len(ids) + r.sim.max_tokens for ids, r in zip(codec.encode_all([r.text for r in reqs]), reqs)]
    assert max(lengths) <= 4096
    again = replay_offline(TextStream(make_workload(name, 2, 0, 2), codec), _answer(codec))
    assert [r.text for r in again] == [r.text for r in reqs]  # same seed, same stream


def test_a_trailing_replacement_character_is_not_sent(codec: TextCodec) -> None:
    stream = TextStream(make_workload("multi_turn", 1, 0, 2), codec)
    first = stream.initial()[0]
    child = stream.follow_up(first, "abc\ufffd")
    assert child is not None and child.text.startswith(first.text + "abc") and "\ufffd" not in child.text


def test_distinct_tokens_counts_the_prefix_trie() -> None:
    assert distinct_tokens([[1, 2, 3], [1, 2, 4], [1, 2], [5]]) == 5
    assert distinct_tokens([]) == 0


def test_sizing_reaches_the_target_with_the_smallest_scale(codec: TextCodec) -> None:
    scale, distinct = size_stream("multi_tenant", 6000, 0, 2, codec)
    assert distinct >= 6000 and estimate_distinct("multi_tenant", scale - 1, 0, 2, codec) < 6000


def test_counters_of_both_stacks() -> None:
    ray = ('ray_vllm_prompt_tokens_total{ReplicaId="a"} 100.0\nray_vllm_prompt_tokens_total{ReplicaId="b"} 50.0\n'
           'ray_vllm_prompt_tokens_by_source_total{ReplicaId="a",source="local_compute"} 60.0\n'
           'ray_vllm_prompt_tokens_by_source_total{ReplicaId="a",source="local_cache_hit"} 40.0\n'
           'ray_vllm_prompt_tokens_by_source_total{ReplicaId="b",source="local_compute"} 50.0\n'
           'ray_vllm_prefix_cache_queries_total{ReplicaId="a"} 170.0\nray_vllm_prefix_cache_hits_total{ReplicaId="a"} 40.0\n'
           'ray_vllm_num_preemptions_total{ReplicaId="b"} 2.0\n')  # fmt: skip
    assert parse_counters(PEER, ray) == Counters(150.0, 110.0, 130.0, 2.0)
    ours = ("swaserve_prompt_tokens_total 90.0\nswaserve_cached_prompt_tokens_total 30.0\n"
            'swaserve_engine_retractions_total{replica="w1"} 1.0\n')  # fmt: skip
    assert parse_counters(OURS, ours) == Counters(90.0, 60.0, None, 1.0)
    assert Counters(10, 5, 4, 1).minus(Counters(4, 2, 1, 0)) == Counters(6, 3, 3, 1)
    assert Counters(10, 5, None, 1).minus(Counters(4, 2, None, 0)).queried_minus_hit is None


def test_stack_commands_and_config(small_model: Path) -> None:
    spec = peer_spec(Path("/p"), small_model, 1, Path("/f"), 3 * 2**20, 2)
    assert spec.command[:2] == ("/p/bin/python", "-P") and "--kv-cache-bytes" in spec.command
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env and spec.env["OMP_NUM_THREADS"] == "1"
    assert spec.health_path == "/v1/models" and not spec.keep_pythonpath
    import yaml

    from deploy.config import ServeConfig

    cfg = ServeConfig(**yaml.safe_load(ours_config(small_model, 3 * 2**20, 0.1)))
    assert (cfg.engine.kv_cache_bytes, cfg.engine.swa_full_tokens_ratio) == (3 * 2**20, 0.1)
    assert cfg.engine_niceness == 0 and cfg.served_model_name == "gemma3-46m"


def test_foreign_load_subtracts_the_runs_own_processes(tmp_path: Path) -> None:
    assert machine_busy_seconds() > 0
    probe = LoadProbe(os.getpid())
    probe.start()
    sum(i * i for i in range(200_000))  # some CPU of our own
    load = probe.stop()
    assert load.own_cores > 0 and load.busy_cores >= 0 and load.foreign_cores >= 0
    assert ForeignLoad(1.0, 1.5, 2.0, 0.0, 0.0).foreign_cores == 0.0


def _run(config: StackConfig, kv: str, computed: float, ttft: float, round_: int = 0) -> ClusterRun:
    results = tuple(RequestResult(f"r{i}", 10, True, "", 100, None, 8, ttft, 2 * ttft) for i in range(4))
    results += (RequestResult("r9", 10, False, "HTTP 500"),)
    run = StreamRun(results, 2.0, "abcdef0123", ("x",) * 5)
    load = ForeignLoad(2.0, 1.5, 1.0, 1.0, 2.0)
    return run_record(config, kv, 48 * 2**20, round_, "multi_turn", run, Counters(400, computed),
                      True, load, 123)  # fmt: skip


def test_tables_and_plot(tmp_path: Path) -> None:
    peer, ours = StackConfig(PEER), StackConfig(OURS, 0.8)
    records = [_run(peer, "pressured", 300, 0.1), _run(ours, "pressured", 150, 0.2),
               _run(ours, "pressured", 250, 0.2, 1), _run(peer, "roomy", 100, 0.1)]  # fmt: skip
    r = records[0]
    assert (r.requests, r.failed, r.finished, r.prompt_tokens, r.output_tokens) == (5, 1, 4, 400, 32)
    assert r.output_throughput == 16.0 and r.errors == ("HTTP 500",)
    table = summary_table(cells(records))
    assert "0.67x" in table and "swaserve r=0.8" in table and "| 8 / 2 |" in table
    assert table.count("\n") == 4  # header, rule, three cells
    assert runs_table(records).count("abcdef01") == 4
    assert plot(cells(records), tmp_path / "p.png").stat().st_size > 0


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cluster_compare.add_arguments(parser)
    args = parser.parse_args(["--ratio", "0", "--output-dir", str(tmp_path)])
    assert cluster_compare.run(args) == 2 and "--ratio" in capsys.readouterr().err
    args = parser.parse_args(["--peer-venv", str(tmp_path / "none"), "--output-dir", str(tmp_path)])
    assert cluster_compare.run(args) == 2 and "none/bin/serve" in capsys.readouterr().err


def test_kv_selects_the_sizes_and_the_streams_keep_the_pressured_size() -> None:
    parser = argparse.ArgumentParser()
    cluster_compare.add_arguments(parser)
    s = cluster_compare.settings_from_args(parser.parse_args(["--kv", "roomy", "roomy"]))
    assert s.kv_sizes() == (("roomy", 192 * 2**20),)
    both = cluster_compare.settings_from_args(parser.parse_args([]))
    assert [name for name, _ in both.kv_sizes()] == ["pressured", "roomy"]


def _smallest(stacks: tuple[str, ...]) -> cluster_compare.ClusterSettings:
    """One round, one small stream, ours at one ratio (0.8 twice): one start per stack and KV size."""
    return cluster_compare.ClusterSettings(
        rounds=1, workloads=("multi_tenant",), stacks=stacks, ratio=0.8, pressured_kv_mib=8,
        roomy_kv_mib=16, fill=0.5, concurrency=2, parity_tokens=8, startup_timeout_s=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.ray
def test_smallest_configuration_on_two_swaserve_replicas(small_model: Path, tmp_path: Path) -> None:
    """Both KV sizes, one small stream: every request finishes, the counters settle, the text
    matches transformers', the same prompts go out each time, and the report is written."""
    s = _smallest((OURS,))
    r = cluster_compare.run_cluster_compare(s, tmp_path, model_dir=small_model)
    assert len(r.runs) == 2 and all(x.failed == 0 and x.requests > 0 for x in r.runs)
    assert all(x.counters_settled and 0 < x.counters.computed_first <= x.prompt_tokens for x in r.runs)
    assert r.parity.agree("transformers", "swaserve r=0.8") == 3
    assert len({x.prompts_digest for x in r.runs}) == 1
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 2  # one line per run, as it ends
    assert "| multi_tenant | roomy 16 MiB | swaserve r=0.8 |" in cluster_compare.summary_markdown(r)
    # one line per request, naming the replica and the router's prediction (ours sends both)
    lines = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == sum(x.requests for x in r.runs)
    assert all(x["replica"] and x["predicted_cached_tokens"] is not None for x in lines)
    assert {x["kv"] for x in lines} == {"pressured", "roomy"}


PEER_VENV = peer_venv(RAY_SERVE_LLM)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(os.environ.get("SWASERVE_BENCH_PEER") != "1" or not is_complete(RAY_SERVE_LLM, PEER_VENV),
                    reason="opt-in: SWASERVE_BENCH_PEER=1 and the Ray Serve LLM venv built")  # fmt: skip
def test_smallest_configuration_with_the_peer(small_model: Path, tmp_path: Path) -> None:
    s = _smallest((PEER, OURS))
    r = cluster_compare.run_cluster_compare(s, tmp_path, model_dir=small_model, peer_venv=PEER_VENV)
    assert all(x.failed == 0 and x.counters_settled for x in r.runs)
    assert r.parity.agree("transformers", PEER_SHORT) == 3

"""`swaserve bench vllm-compare` without vLLM: the model directory, result parsing, the tables,
process roles; the vLLM run itself only when asked (SWASERVE_BENCH_VLLM=1) and installed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from bench.compare import vllm_compare
from bench.compare.client import (
    ClientResult,
    client_command,
    counter_sum,
    default_workloads,
    parse_result,
)
from bench.compare.model import CompareModelShape, build_compare_model, ensure_compare_model
from bench.compare.peers import VLLM_CPU, peer_venv
from bench.compare.procs import (
    cpu_seconds,
    descendants,
    role_pids,
    thread_comms,
    thread_cpu_seconds,
)
from bench.compare.report import (
    IdleRecord,
    RunRecord,
    compare,
    comparison_table,
    idle_table,
    runs_table,
    serving_table,
)

SMALL = CompareModelShape(hidden=64, layers=6, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                          sliding_window=16, max_positions=512)  # fmt: skip


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_compare_model(tmp_path_factory.mktemp("cache"), SMALL)


def test_model_dir_is_deterministic_gemma3(small_model: Path, tmp_path: Path) -> None:
    """A second build writes byte-identical files: Gemma-3 text, 5:1 sliding/full, float32."""
    again = tmp_path / "again"
    again.mkdir()
    build_compare_model(again, SMALL)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / f).read_bytes() == (small_model / f).read_bytes(), f
    cfg = json.loads((small_model / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 16
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] is True


@pytest.mark.slow
def test_engine_greedy_equals_transformers_on_the_model(small_model: Path) -> None:
    """Our engine's greedy text of the parity prompts (past the window) is transformers'."""
    from transformers import AutoTokenizer

    from bench.compare.parity import comparable, parity_prompts, transformers_texts
    from core.sampling_params import SamplingParams
    from worker.config import EngineConfig
    from worker.engine.engine import Engine

    prompts = parity_prompts(small_model, (10, 40))
    assert all(len(p) == n for p, n in zip(prompts, (10, 40)))
    theirs = transformers_texts(small_model, prompts, 12)
    outs = Engine(EngineConfig(model=str(small_model))).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    tok = AutoTokenizer.from_pretrained(str(small_model))
    ours = [str(tok.decode(o.token_ids, skip_special_tokens=True)) for o in outs]
    assert [comparable(t) for t in ours] == [comparable(t) for t in theirs]


def _client(throughput: float, tpot: float, tokens: int = 1000) -> ClientResult:
    return ClientResult(completed=8, failed=0, duration_s=tokens / throughput, input_tokens=2048,
                        output_tokens=tokens, output_throughput=throughput, mean_tpot_ms=tpot,
                        median_tpot_ms=tpot, mean_ttft_ms=100.0, mean_itl_ms=tpot)  # fmt: skip


def test_parse_result_reads_vllm_bench_json(tmp_path: Path) -> None:
    """The fields of `vllm bench serve --save-result` that the table uses."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({
        "completed": 64, "failed": 0, "duration": 20.5, "total_input_tokens": 16384,
        "total_output_tokens": 4096, "output_throughput": 199.8, "mean_tpot_ms": 35.1,
        "median_tpot_ms": 33.0, "mean_ttft_ms": 410.0, "mean_itl_ms": 35.0, "latencies": [1.0],
        "p99_ttft_ms": 920.5,
    }))  # fmt: skip
    r = parse_result(path)
    assert (r.completed, r.output_tokens, r.output_throughput, r.mean_tpot_ms) == (64, 4096, 199.8, 35.1)
    assert r.p99_ttft_ms == 920.5


def test_serving_table_takes_each_idle_floor_out() -> None:
    """The HTTP side is vLLM's API server against our ingress + worker; above idle, each
    server's floor (same server, same round) times the run's duration comes off."""
    def rec(server: str, cpu: dict[str, float], ttft: float, p99: float) -> RunRecord:
        client = dataclasses.replace(_client(100.0, 30.0, tokens=1000), mean_ttft_ms=ttft, p99_ttft_ms=p99)
        return RunRecord(server, 0, "random c=8", client, 2048, 0, cpu, 1.0, 1.0)  # 10 s runs

    vllm = rec("vllm", {"api_server": 0.40, "engine_core": 9.0}, 200.0, 400.0)
    ours = rec("swaserve", {"ingress": 0.70, "worker": 0.50, "engine": 9.0, "proxy": 0.2}, 150.0, 500.0)
    (c,) = compare([vllm, ours])
    assert c.ttft_ratio == pytest.approx(0.75) and c.p99_ttft_ratio == pytest.approx(1.25)
    assert ours.http_per_1k_tokens() == pytest.approx(1.2) and c.http_ratio() == pytest.approx(3.0)
    idles = [IdleRecord("vllm", 0, 20.0, {"api_server": 0.04}),  # 0.2 % of a core
             IdleRecord("swaserve", 0, 20.0, {"ingress": 0.3, "worker": 0.3, "proxy": 0.3})]  # 3 %
    # ours: 1.2 - 0.03 * 10 s = 0.9 CPU-s over 1,000 tokens; vLLM's: 0.40 - 0.002 * 10 = 0.38
    assert ours.http_per_1k_tokens(idles[1]) == pytest.approx(0.9)
    assert c.http_ratio(idles) == pytest.approx(0.9 / 0.38)
    assert math.isnan(c.http_ratio(idles[:1]))  # our floor not measured: no ratio above it
    table = serving_table([c], idles)
    assert "| 200; 150 | 0.75x | 400; 500 | 1.25x | 0.40; 1.20 | 3.00x | 0.38; 0.90 | 2.37x |" in table
    assert serving_table([c], []).endswith("| -; - | - |")
    rest = idle_table(idles)
    assert "| 0 | swaserve | 20 | - | 1.50 | 1.50 | 1.50 | 3.00 |" in rest  # proxy not in the HTTP side
    assert "| 0 | vllm | 20 | 0.20 | - | - | - | 0.20 |" in rest


def test_best_runs_ratios_and_tables() -> None:
    """Per workload each server's best run counts; ratios are swaserve over vLLM."""
    def rec(server: str, rnd: int, tput: float, tpot: float) -> RunRecord:
        return RunRecord(server, rnd, "random c=8", _client(tput, tpot), 2048, 512,
                         {"worker": 4.0, "ingress": 1.0}, 1.0, 1.5)  # fmt: skip

    records = [rec("vllm", 0, 200, 30), rec("swaserve", 0, 90, 70), rec("swaserve", 1, 100, 60),
               rec("vllm", 1, 180, 35)]  # fmt: skip
    (c,) = compare(records)
    assert c.best["vllm"].round == 0 and c.best["swaserve"].round == 1
    assert c.throughput_ratio == pytest.approx(0.5) and c.tpot_ratio == pytest.approx(2.0)
    table = comparison_table([c])
    assert "**0.50x**" in table and "2.00x" in table and "0.5K / 2.0K" in table
    runs = runs_table(records)
    assert "worker CPU-s / 1k tok" in runs and "| 4.00 |" in runs and runs.count("\n") == 5
    assert compare(records[:1]) == []  # a workload one server lacks is left out


def test_client_commands_and_workloads() -> None:
    """Same flags for every run; each workload its own seed; the shared-prefix dataset."""
    ws = default_workloads()
    assert [w.name for w in ws] == ["random c=1", "random c=8", "random c=32", "shared prefix c=8"]
    assert len({w.seed for w in ws}) == len(ws)
    cmd = client_command(Path("vllm"), ws[-1], "http://127.0.0.1:1", Path("/m"), Path("/o/r.json"))
    for flag in ("--ignore-eos", "--backend", "--max-concurrency", "--save-result"):
        assert flag in cmd
    assert cmd[cmd.index("--dataset-name") + 1] == "prefix_repetition"
    assert cmd[cmd.index("--temperature") + 1] == "0" and cmd[cmd.index("--num-prompts") + 1] == "64"


def test_counter_sum_adds_labelled_samples() -> None:
    text = ('# HELP vllm:prompt_tokens_total x\nvllm:prompt_tokens_total{engine="0",model_name="m"} 30.0\n'
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 12.0\nvllm:prompt_tokens_total_created 5.0\n'
            "swaserve_prompt_tokens_total 7.0\n")  # fmt: skip
    assert counter_sum(text, "vllm:prompt_tokens_total") == 42.0
    assert counter_sum(text, "swaserve_prompt_tokens_total") == 7.0


def _fake_proc(root: Path, pid: int, ppid: int, title: str, utime: int, nice: int = 0) -> None:
    d = root / str(pid)
    d.mkdir()
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), "0"] + ["0"] * 3 + [str(nice)]
    (d / "stat").write_text(f"{pid} (python) {' '.join(fields)} 0 0\n")
    (d / "cmdline").write_bytes(title.replace(" ", "\0").encode())


def test_process_roles_are_the_started_servers_own(tmp_path: Path) -> None:
    """Roles come from the titles below the started PID only; CPU = utime + stime."""
    ticks = os.sysconf("SC_CLK_TCK")
    _fake_proc(tmp_path, 10, 1, "python -m deploy serve", 0)
    _fake_proc(tmp_path, 11, 10, "raylet", 0)
    _fake_proc(tmp_path, 12, 11, "ray::ServeReplica:swaserve:Worker", 3 * ticks)
    _fake_proc(tmp_path, 13, 11, "ray::ServeReplica:swaserve:Ingress", ticks)
    _fake_proc(tmp_path, 14, 11, "ray::ProxyActor", ticks)
    _fake_proc(tmp_path, 15, 12, "/venv/bin/python -c import runpy, sys; runpy.run_module('worker.hosts.engine_process') /r /tmp/s", 5 * ticks)
    _fake_proc(tmp_path, 20, 1, "ray::ServeReplica:swaserve:Worker", ticks)  # someone else's
    assert {p.pid for p in descendants(10, tmp_path)} == {10, 11, 12, 13, 14, 15}
    roles = role_pids(10, tmp_path)
    assert roles == {"worker": [12], "engine": [15], "ingress": [13], "proxy": [14]}
    assert cpu_seconds(roles, tmp_path) == {"worker": 3.0, "engine": 5.0, "ingress": 1.0, "proxy": 1.0}


def test_thread_cpu_and_names(tmp_path: Path) -> None:
    """Per-thread CPU seconds and kernel names of one process."""
    ticks = os.sysconf("SC_CLK_TCK")
    _fake_proc(tmp_path, 30, 1, "ray::ServeReplica:swaserve:Worker", 6 * ticks)
    tasks = tmp_path / "30" / "task"
    tasks.mkdir()
    for tid, name, t in ((30, "ray::ServeRepli", 1), (31, "swaserve-engine", 4), (32, "worker.io", 1)):
        _fake_proc(tasks, tid, 1, "x", t * ticks)
        stat = tasks / str(tid) / "stat"
        stat.write_text(stat.read_text().replace("(python)", f"({name})"))
    assert thread_cpu_seconds(30, tmp_path) == {30: 1.0, 31: 4.0, 32: 1.0}
    assert thread_comms(30, tmp_path) == {30: "ray::ServeRepli", 31: "swaserve-engine", 32: "worker.io"}
    assert thread_cpu_seconds(99, tmp_path) == {} == thread_comms(99, tmp_path)


def test_without_vllm_the_command_says_where_it_looked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    vllm_compare.add_arguments(parser)
    args = parser.parse_args(["--vllm", str(tmp_path / "no-vllm"), "--output-dir", str(tmp_path)])
    assert vllm_compare.run(args) == 2
    assert "no vllm CLI" in capsys.readouterr().err


VLLM = Path(os.environ.get("SWASERVE_VLLM", str(peer_venv(VLLM_CPU) / "bin" / "vllm")))


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(os.environ.get("SWASERVE_BENCH_VLLM") != "1" or not VLLM.is_file(),
                    reason="opt-in: SWASERVE_BENCH_VLLM=1 and a vllm CLI (SWASERVE_VLLM, else the peer venv's)")  # fmt: skip
def test_side_by_side_on_the_small_model(small_model: Path, tmp_path: Path) -> None:
    """Both servers, one round, tiny workloads: every run completes, greedy text agrees."""
    s = vllm_compare.CompareSettings(rounds=1, num_prompts=8, output_len=8, input_len=64,
                                     concurrencies=(2,), shared_prefix_concurrency=2,
                                     parity_tokens=8, vllm=str(VLLM))  # fmt: skip
    r = vllm_compare.run_compare(s, tmp_path, model_dir=small_model)
    assert len(r.comparisons) == 2 and all(x.best["vllm"].client.completed == 8 for x in r.comparisons)
    assert r.parity.agree("transformers", "vllm") == r.parity.agree("transformers", "swaserve") == 3

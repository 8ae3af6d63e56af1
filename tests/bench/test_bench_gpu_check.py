"""`swaserve bench gpu-check` on a machine without CUDA says so and runs nothing; its byte
count of a decode step's KV reads follows the window rule; its engine-driving parts (the
bandwidth admission, the graph-vs-eager batch) run on the CPU with the torch backend."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.sim_runner import sim_spec
from worker.engine.engine import Engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_no_cuda_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    assert gpu_check.run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "nothing was run" in out and "pass" not in out


def test_kv_bytes_read_counts_full_and_window_keys() -> None:
    spec = sim_spec(window=16)  # 2 full + 6 SWA layers, 2 KV heads x (64 + 64), bf16
    per_token = 2 * (64 + 64) * 2
    assert gpu_check.kv_bytes_read(spec, 3, 1000) == 3 * per_token * (2 * 1000 + 6 * 17)
    assert gpu_check.kv_bytes_read(spec, 1, 10) == per_token * 8 * 10


@pytest.fixture(scope="module")
def dense_cpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The check's random Gemma-3-style model, tiny, written on the CPU."""
    small = gpu_check.GpuCheckSettings(hidden=128, layers=6, vocab=512)
    return gpu_check.dense_model_dir(tmp_path_factory.mktemp("dense"), small, device="cpu")


def _cpu_engine(path: Path, s: gpu_check.GpuCheckSettings, batch: int, overlap: str) -> Engine:
    config = gpu_check.engine_config(path, "torch", "off", s, batch, overlap=overlap, device="cpu")
    return Engine(replace(config, compile="off"))


def test_bandwidth_admits_every_prompt_before_the_first_finishes(dense_cpu: Path) -> None:
    """Prompts much longer than a step's budget: the first admitted request still decodes when
    the timed steps end (it used to ask for batch + steps + 16 tokens and finish mid-admission)."""
    s = gpu_check.GpuCheckSettings(vocab=512, prompts=1, batch=3, context=700, steps=3, step_tokens=64,
                                   swa_ratio=1.0)  # fmt: skip
    assert s.batch + s.steps + 16 < (s.batch * s.context) // s.step_tokens + gpu_check.WARM_STEPS + s.steps
    engine = _cpu_engine(dense_cpu, s, s.batch, overlap="off")
    try:
        assert gpu_check.steady_decode(engine, s) > 0
    finally:
        engine.close()


def test_graph_vs_eager_runs_its_own_batch_only_without_overlap(dense_cpu: Path) -> None:
    """The comparison schedules a batch outside `step`: refused while steps overlap (a decode's
    input would still be sampling); without overlap the batch runs twice to the same logits."""
    s = gpu_check.GpuCheckSettings(vocab=512, prompts=2, context=600, swa_ratio=1.0)
    prompts = [[2 + (7 * i + j) % 500 for j in range(40 + i)] for i in range(2)]
    engine = _cpu_engine(dense_cpu, s, 2, overlap="on")
    try:
        with pytest.raises(AssertionError, match="overlap_schedule off"):
            gpu_check.graph_vs_eager(engine, prompts)
    finally:
        engine.close()
    engine = _cpu_engine(dense_cpu, s, 2, overlap="off")
    try:
        assert gpu_check.graph_vs_eager(engine, prompts) == (2, 0.0, True)
    finally:
        engine.close()

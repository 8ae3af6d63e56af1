"""`swaserve bench gpu-check` on a machine without CUDA says so and runs nothing; its byte
count of a decode step's KV reads follows the window rule; its engine-driving parts (the
bandwidth admission, the graph-vs-eager batch) run on the CPU with the torch backend."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.sim_runner import sim_spec
from worker.engine.engine import Engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_dry_run_skips_every_step_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA every step is listed as skipped with the reason, none passes, the exit status
    is 0, and the table is written under --out as on the device."""
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    assert gpu_check.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    print(out)  # the dry run's table, for the record (pytest -s)
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["check"] for r in rows] == [st.name for st in gpu_check.STEPS]
    assert all(r["skipped"] and r["ok"] is None and gpu_check.NO_CUDA in r["result"] for r in rows)
    assert "pass" not in out and "FAIL" not in out and out.count("skipped: ") == len(gpu_check.STEPS)
    assert "| skipped |" in (tmp_path / "gpu_check.md").read_text()


def test_skip_reasons_name_what_is_missing() -> None:
    """CUDA first, then FlashInfer; the quantized step needs CUDA only (its rows say why a
    kernel cannot run)."""
    steps = {st.name: st for st in gpu_check.STEPS}
    no_fi = {"cuda": True, "flashinfer": False}
    assert gpu_check.skip_reason(steps["kernels"], no_fi) == gpu_check.NO_FLASHINFER
    assert gpu_check.skip_reason(steps["kernels"], {**no_fi, "cuda": False}) == gpu_check.NO_CUDA
    assert gpu_check.skip_reason(steps["kernels"], {**no_fi, "flashinfer": True}) is None
    assert gpu_check.skip_reason(steps["quantized"], no_fi) is None


def test_quantized_step_builds_its_weights_and_declines_the_kernels_on_cpu() -> None:
    """The quantized step's random MXFP4 experts run the per-expert path on the CPU (small
    shapes), and the step reports each kernel skipped with its reason there."""
    moe = gpu_check.random_mxfp4_moe("cpu", 64, 64, 4, 2)
    x = torch.randn(3, 64).to(gpu_check.DTYPE)
    with torch.inference_mode():
        y = moe.mix(x)
    assert y.shape == x.shape and y.dtype == gpu_check.DTYPE and y.abs().max() > 0
    ctx = gpu_check.Context(gpu_check.GpuCheckSettings(), Path("."), device="cpu")
    rows = gpu_check.quantized_parity(ctx, (64, 64, 4, 2))
    assert [r.skipped for r in rows] == [True, True]
    assert "CUDA's (device cpu)" in rows[0].result and "CUDA's (device cpu)" in rows[1].result


def test_kernel_cases_rehearse_on_cpu() -> None:
    """The kernel step's inputs (pools, flat and paged views, MiMo's 192/128 dims, the 32k-key
    decode) built on the CPU and run through two torch backends: the same attention."""
    from worker.attention.torch_backend import TorchBackend

    rows = gpu_check.kernel_parity(None, "cpu", lambda pool, spec, device: TorchBackend(pool, kernel=False))
    assert len(rows) == len(gpu_check.KERNEL_CASES) + sum(c.full for c in gpu_check.KERNEL_CASES)
    assert all(r.ok for r in rows), rows


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


def test_engine_steps_rehearse_on_cpu(tmp_path: Path) -> None:
    """The engine steps run end to end on the CPU with the torch backend standing in for
    FlashInfer (small settings): no step raises; greedy runs agree (the same backend); the
    graph rows say graphs need CUDA, skipped; the dense and MoE compile rows agree."""
    s = gpu_check.GpuCheckSettings(hidden=128, layers=6, vocab=512, prompts=2, new_tokens=8, batch=3,
                                   context=700, steps=2, step_tokens=64, swa_ratio=1.0)  # fmt: skip
    ctx = gpu_check.Context(s, tmp_path, device="cpu", backend="torch")
    rows = {r.check: r for step in ("greedy", "graph-logits", "overlap", "bandwidth")
            for r in next(st for st in gpu_check.STEPS if st.name == step).run(ctx)}  # fmt: skip
    assert rows["greedy torch vs flashinfer"].ok and rows["greedy flashinfer vs flashinfer+graphs"].ok
    assert rows["decode steps served by a graph"].result == "0"
    graph_rows = [r for name, r in rows.items() if name.startswith("graph vs eager logits")]
    assert len(graph_rows) == 4 and all(r.skipped and "CUDA graphs need a CUDA device" in r.result for r in graph_rows)
    assert rows["greedy compile off vs auto, dense"].ok and rows["greedy compile off vs auto, MoE tiny MiMo"].ok
    assert rows["greedy overlap off vs on (FlashInfer, graphs)"].ok
    assert [r.ok for name, r in rows.items() if name.startswith("decode bandwidth")] == [None, None]

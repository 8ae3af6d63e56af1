"""The tensor-parallel pool check's digests (`pool_report`): float64 sums of every K and V
element, taken a chunk of rows at a time, never a float64 copy of a whole KV buffer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import worker.parallel.runner as tp_runner
from worker.kv.pool import HybridKVPool
from worker.models.spec import KindShape, LayerKind, ModelSpec


class _Float64Sizes(TorchDispatchMode):
    """The element count of every float64 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None) -> object:  # fmt: skip
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.sizes.append(out.numel())
        return out


def test_digests_sum_in_float64_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each buffer (here 1,028 rows x 2 heads x 32) is summed in float64 chunks of at most
    `DIGEST_CHUNK_ELEMS` elements; the digest is the float64 sum all the same."""
    shape = KindShape(4, 2, 16, 16)
    spec = ModelSpec("t", (LayerKind.FULL, LayerKind.SWA), 7, shape, shape, 64, 32, 4096)
    pool = HybridKVPool(spec, 1024, 512, 4, torch.float32, torch.device("cpu"), hybrid=True)
    gen = torch.Generator().manual_seed(0)
    for lid in range(spec.num_layers):
        for buf in pool.kv_buffers(lid):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    monkeypatch.setattr(tp_runner, "DIGEST_CHUNK_ELEMS", 4096)
    with _Float64Sizes() as mode:
        report = tp_runner.pool_report(pool, spec, rank=0)
    assert mode.sizes and max(mode.sizes) <= 4096, max(mode.sizes)
    for kind, lid in ((LayerKind.FULL, 0), (LayerKind.SWA, 1)):
        exact = sum(float(b.double().sum()) for b in pool.kv_buffers(lid))
        assert report.digests[kind] == pytest.approx(exact, rel=1e-12, abs=1e-9)

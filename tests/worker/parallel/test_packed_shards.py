"""Each tensor-parallel layer's `packed()` (`compile: auto` on CPU packs every rank's shard)
computes what its eager forward computes; the row-parallel one keeps its all-reduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.models.packed import PackedLinear
from worker.models.panel_kernel import panel_kernel
from worker.parallel.layers import (
    ColumnParallelLinear,
    PackedRowParallelLinear,
    RowParallelLinear,
    VocabParallelHead,
)


class _DoublingGroup:
    """Stands in for a 2-rank `TPGroup` whose peer holds the same partial sum."""

    def __init__(self) -> None:
        self.reduced = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced += 1
        return 2 * x


def _filled(module: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    return module


@pytest.mark.parametrize("panel_copy", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_packed_shards_match_their_eager_forward(rows: int, panel_copy: bool) -> None:
    """Column, row (with the all-reduce and bias after it) and vocab-head shards, packed; with
    panel copies (a small step runs on them where the kernel builds)."""
    group = _DoublingGroup()
    x = torch.randn(rows, 64)
    shards = [
        _filled(ColumnParallelLinear(nn.Linear(64, 96, bias=True), 48)),
        _filled(RowParallelLinear(nn.Linear(128, 64, bias=True), 64, group)),  # type: ignore[arg-type]
        _filled(VocabParallelHead(nn.Linear(64, 100, bias=False), 50)),
    ]
    for shard in shards:
        packed = shard.packed(panel_copy)
        assert not isinstance(packed, type(shard))
        kept = panel_copy and panel_kernel() is not None
        assert all((m.panels is not None) == kept for m in packed.modules() if isinstance(m, PackedLinear))
        torch.testing.assert_close(packed(x), shard(x), rtol=1e-5, atol=1e-5)
    assert isinstance(shards[1].packed(), PackedRowParallelLinear)
    assert group.reduced == 2  # eager and packed row-parallel forward each reduced once

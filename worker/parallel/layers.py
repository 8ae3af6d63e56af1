"""Tensor-parallel layers (docs/design.md §17.2). Parameter names equal the layers they replace
(``weight``, ``bias``), so checkpoints load by name and only the slice differs.

    column-parallel   y[:, mine] = x @ W[mine].T + b[mine]        no communication
    row-parallel      y = all_reduce(x[:, mine] @ W[:, mine].T) + b   one all-reduce
    vocab-parallel    embedding rows and LM-head rows split by token id; the embedding sums
                      (one rank holds each id), the head's logits are gathered at rank 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.layers import rounded_scale
from worker.models.packed import PackedLinear
from worker.parallel.group import TPGroup


@dataclass(frozen=True)
class Slice:
    """This rank's part of one checkpoint tensor: `length` entries from `start` along `dim`.

    The parameter may be longer along `dim` than `length` (the vocab padded to a multiple of
    the group size): the entries past it stay zero.
    """

    dim: int
    start: int
    length: int
    full: int  # the checkpoint tensor's size along `dim`

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.length)

    def full_shape(self, dst: torch.Tensor) -> tuple[int, ...]:
        shape = list(dst.shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def copy_into(self, dst: torch.Tensor, part: torch.Tensor) -> None:
        """`part` (already this rank's slice) into `dst`, zero-filling any padding."""
        head = dst.narrow(self.dim, 0, self.length)
        head.copy_(part)
        pad = dst.size(self.dim) - self.length
        if pad:
            dst.narrow(self.dim, self.length, pad).zero_()


def _param(*shape: int, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))


class ColumnParallelLinear(nn.Module):
    """A shard of `nn.Linear`'s output features (rows of the weight)."""

    def __init__(self, orig: nn.Linear, out_local: int) -> None:
        super().__init__()
        self.weight = _param(out_local, orig.in_features, like=orig.weight)
        self.bias = None if orig.bias is None else _param(out_local, like=orig.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def packed(self, panel_copy: bool = False) -> nn.Module:
        """This shard with its weight packed for oneDNN (`worker.models.packed`)."""
        return PackedLinear(self.weight, self.bias, panel_copy)


class RowParallelLinear(nn.Module):
    """A shard of `nn.Linear`'s input features; the partial products are summed over ranks, then
    the (whole, replicated) bias is added once."""

    def __init__(self, orig: nn.Linear, in_local: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = _param(orig.out_features, in_local, like=orig.weight)
        self.bias = None if orig.bias is None else _param(orig.out_features, like=orig.bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def packed(self, panel_copy: bool = False) -> nn.Module:
        """This shard's local product packed for oneDNN; the all-reduce and bias unchanged."""
        local = PackedLinear(self.weight, None, panel_copy)
        return PackedRowParallelLinear(local, self.bias, self.group)


class PackedRowParallelLinear(nn.Module):
    """`RowParallelLinear` after `pack_linears`: the packed partial product, summed over ranks."""

    def __init__(self, local: PackedLinear, bias: torch.Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.local = local
        self.bias = bias
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.local(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding; ids elsewhere look up zeros, and the sum
    over ranks is the lookup (exact: one rank holds each id). `scale` repeats Gemma's
    `ScaledEmbedding` arithmetic after the sum."""

    def __init__(
        self, orig: nn.Embedding, start: int, rows: int, group: TPGroup, scale: float | None
    ) -> None:
        super().__init__()
        self.weight = _param(rows, orig.embedding_dim, like=orig.weight)
        self.start, self.rows, self.group = start, rows, group
        self.scales = None if scale is None else rounded_scale(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        h = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1)
        h = self.group.all_reduce(h)
        if self.scales is None:
            return h
        return h * self.scales[self.weight.dtype]  # as ScaledEmbedding (no tensor per call)


class VocabParallelHead(nn.Module):
    """Rows ``[start, start + rows)`` of the LM head: this rank's slice of the logits. Rank 0
    gathers the slices (`TPGroup.gather_last_dim`) and drops the padding columns."""

    def __init__(self, orig: nn.Linear, rows: int) -> None:
        super().__init__()
        self.weight = _param(rows, orig.in_features, like=orig.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def packed(self, panel_copy: bool = False) -> nn.Module:
        """This slice of the head packed for oneDNN (`worker.models.packed`)."""
        return PackedLinear(self.weight, None, panel_copy)

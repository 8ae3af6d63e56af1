"""The attention-backend interface: per-batch metadata built once per layer kind, then one call
per layer.

The runner hands every backend the same `AttnBatch`: for each layer kind the slots a request's
queries may read, already in that kind's pool (SWA slots translated once per batch), plus the
positions. A backend turns it into its own metadata in `plan` (page tables, masks, planned
kernels) and reuses it for every layer of that kind in `forward`.

Window rule (docs/design.md §1): on an SWA layer a query at q reads keys q-window … q. The SWA
view of a request therefore starts at ``max(0, prefix_len - window)``: the first new query needs
those keys, later queries need fewer, and the backend masks per query.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from worker.models.spec import LayerKind


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer (static, built at model init)."""

    layer_id: int
    kind: LayerKind
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    softcap: float | None = None  # tanh cap on attention logits (Gemma 2)


@dataclass(frozen=True)
class KVView:
    """The keys one layer kind may read in a batch, request-major.

    ``indices[indptr[i]:indptr[i+1]]`` are request i's slots (in the pool that kind lives in) for
    key positions ``kv_starts[i] … seq_lens[i] - 1``.
    """

    indices: torch.Tensor  # int64 [sum of kv lens], on the model device
    indptr: torch.Tensor  # int64 [B + 1], on the model device
    kv_starts: tuple[int, ...]  # position of each request's first key (0 for FULL)

    def kv_len(self, i: int) -> int:
        return int(self.indptr[i + 1] - self.indptr[i])


@dataclass(frozen=True)
class AttnBatch:
    """One forward's attention inputs, shared by all backends.

    Queries are the new tokens of every request, concatenated (``T = sum(q_lens)``).
    """

    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]  # prefix_len + q_len: the new end of each request
    positions: torch.Tensor  # int64 [T] on the model device
    kv: Mapping[LayerKind, KVView]  # one view per layer kind the model has
    window: int | None  # keys to the left on SWA layers (docs/design.md §1)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(s - q for s, q in zip(self.seq_lens, self.q_lens))


class AttentionBackend(ABC):
    """Reads K/V from a `HybridKVPool` and computes attention for one layer at a time."""

    name: str = "base"

    @abstractmethod
    def plan(self, batch: AttnBatch) -> Any:
        """Build this backend's metadata for a batch, once per layer kind.

        Args:
            batch: the batch's positions and per-kind key views.
        Returns:
            An opaque metadata object the model passes back to `forward` for every layer.
        """

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        metadata: Any,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer; this layer's new K/V are already in the pool.

        Args:
            layer: the layer's static description (kind, heads, scale, softcap).
            q: ``[T, num_q_heads, head_dim]`` queries after rope.
            metadata: what `plan` returned for this batch.
            sinks: ``[num_q_heads]`` learned logits added to each softmax denominator, or None.
        Returns:
            ``[T, num_q_heads, v_head_dim]`` in q's dtype.
        """


def check_views(batch: AttnBatch) -> None:
    """Assert the per-kind views cover exactly what the window rule needs (debug aid)."""
    for kind, view in batch.kv.items():
        for i, (seq, q_len) in enumerate(zip(batch.seq_lens, batch.q_lens)):
            need = 0 if kind is LayerKind.FULL else max(0, seq - q_len - (batch.window or 0))
            if view.kv_starts[i] != need or view.kv_len(i) != seq - need:
                raise AssertionError(
                    f"{kind.value} view of request {i} covers [{view.kv_starts[i]}, "
                    f"{view.kv_starts[i] + view.kv_len(i)}), expected [{need}, {seq})"
                )

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
    """The keys one layer kind may read in a batch, request-major, in one of two forms.

    Flat (``indices`` set): ``indices[indptr[i]:indptr[i+1]]`` are request i's slots (in the pool
    that kind lives in) for key positions ``kv_starts[i] … seq_lens[i] - 1``. The SWA view is
    always flat (host-built, bounded by the window).

    Paged (``table`` set, docs/design.md §18.1): request i's slot of position p is
    ``table[rows[i], p]``, for ``p`` in ``kv_starts[i] … kv_starts[i] + kv_lens[i] - 1``. The
    table is the runner's persistent device page table; nothing of size O(tokens) crossed from
    the host this step. `flat_indices` builds the flat form on the device when a kernel needs it.
    """

    indices: torch.Tensor | None  # int64 [sum of kv lens], on the model device (flat form)
    indptr: torch.Tensor | None  # int64 [B + 1], on the model device (flat form)
    kv_starts: tuple[int, ...]  # position of each request's first key (0 for FULL)
    kv_lens: tuple[int, ...] = ()  # keys per request (host ints); () = read from indptr
    table: torch.Tensor | None = None  # int32/int64 [rows, width], model device (paged form)
    rows: tuple[int, ...] = ()  # each request's table row (host ints, paged form)
    row_ids: torch.Tensor | None = None  # int64 [B]: the same on the device (paged form)
    starts_dev: torch.Tensor | None = None  # int64 [B]: kv_starts on the device (paged form)
    lens_dev: torch.Tensor | None = None  # int64 [B]: kv_lens on the device (paged form)

    @classmethod
    def paged(
        cls,
        table: torch.Tensor,
        rows: tuple[int, ...],
        row_ids: torch.Tensor,
        kv_starts: tuple[int, ...],
        kv_lens: tuple[int, ...],
        starts_dev: torch.Tensor | None = None,
        lens_dev: torch.Tensor | None = None,
    ) -> KVView:
        """A paged view; the device copies of the starts and lengths are built if not given."""
        dev = table.device
        if starts_dev is None:
            starts_dev = torch.tensor(kv_starts, dtype=torch.int64, device=dev)
        if lens_dev is None:
            lens_dev = torch.tensor(kv_lens, dtype=torch.int64, device=dev)
        return cls(None, None, kv_starts, kv_lens, table, rows, row_ids, starts_dev, lens_dev)

    @property
    def device(self) -> torch.device:
        t = self.table if self.table is not None else self.indices
        assert t is not None, "a KVView holds a table or indices"
        return t.device

    def kv_len(self, i: int) -> int:
        if self.kv_lens:
            return self.kv_lens[i]
        assert self.indptr is not None
        return int(self.indptr[i + 1] - self.indptr[i])

    def segment(self, i: int, kv_off: int, n: int) -> torch.Tensor:
        """Request i's first `n` key slots (`kv_off`: where they start in the flat form)."""
        if self.table is not None:
            start = self.kv_starts[i]
            return self.table[self.rows[i], start : start + n].long()
        assert self.indices is not None
        return self.indices[kv_off : kv_off + n]

    def padded(
        self, members: list[int], kv_offs: list[int], L: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key slots ``[G*L]`` of requests `members` padded with slot 0, and which are real
        (bool ``[G, L]``). One device gather in either form; no host sync."""
        dev = self.device
        ell = torch.arange(L, device=dev)[None, :]
        lens = torch.tensor([self.kv_len(i) for i in members], device=dev)[:, None]
        key_ok = ell < lens
        if self.table is not None:
            assert self.row_ids is not None
            sel = torch.tensor(members, device=dev)
            starts = torch.tensor([self.kv_starts[i] for i in members], device=dev)[:, None]
            cols = torch.where(key_ok, starts + ell, 0)
            slots = self.table[self.row_ids[sel][:, None], cols].long()
        else:
            assert self.indices is not None
            offs = torch.tensor(kv_offs, device=dev)[:, None]
            slots = self.indices[torch.where(key_ok, offs + ell, 0)]
        return torch.where(key_ok, slots, 0).reshape(-1), key_ok

    def flat_indices(self) -> torch.Tensor:
        """The flat form's `indices` (int64, model device), built on the device from the table
        for a paged view: O(keys) device work, O(batch) host work, no host sync."""
        if self.indices is not None:
            return self.indices
        assert self.table is not None and self.row_ids is not None
        assert self.lens_dev is not None and self.starts_dev is not None
        dev, total, lens = self.table.device, sum(self.kv_lens), self.lens_dev
        seg_start = torch.cumsum(lens, 0) - lens  # where each request's keys start in the output
        shift = self.starts_dev - seg_start
        rows = torch.repeat_interleave(self.row_ids, lens, output_size=total)
        cols = torch.arange(total, device=dev) + torch.repeat_interleave(
            shift, lens, output_size=total
        )
        return self.table[rows, cols].long()


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

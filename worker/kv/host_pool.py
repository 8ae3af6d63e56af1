"""The host tier's memory (docs/design.md §9.9): page allocators and KV buffers in host memory,
one pair per device pool (FULL: the full layers, SWA: the sliding-window layers).

    host pool of one kind      page 0 (reserved) | page 1 | page 2 | ...
    K buffer  [pages + 1, layers of the kind, P, kv heads, head_dim]
    V buffer  [pages + 1, layers of the kind, P, kv heads, v_head_dim]

A page holds *every* layer of its kind (page-major, unlike the device pools' one tensor per
layer), so a run of consecutive host pages is one contiguous block: a copy between the tiers is
one gather or scatter per layer on the device side and one block copy per run of host pages
(`worker/kv/transfer.py`). Host slots number like device slots (page p holds slots
``[p * P, (p + 1) * P)``), so the tree keeps them the way it keeps device slots.

The buffers are pinned on CUDA (asynchronous copies need page-locked memory) and ordinary
memory on CPU. All-SWA models have no full layer: the host full pool is addresses only.
"""

from __future__ import annotations

import torch

from worker.kv.allocator import PageAllocator
from worker.kv.hybrid_allocator import page_slots
from worker.kv.memory_plan import HostPlan
from worker.models.spec import LayerKind, ModelSpec

_I64 = torch.int64


class HostAllocator:
    """The host tier's free pages: one `PageAllocator` per device pool, sizes in tokens."""

    def __init__(self, full_tokens: int, swa_tokens: int, page_size: int) -> None:
        self.page_size = page_size
        self._pages = {
            LayerKind.FULL: PageAllocator(full_tokens // page_size, page_size, "host full"),
            LayerKind.SWA: PageAllocator(swa_tokens // page_size, page_size, "host SWA"),
        }

    @classmethod
    def from_plan(cls, plan: HostPlan) -> HostAllocator:
        return cls(plan.full_tokens, plan.swa_tokens, plan.page_size)

    def size(self, kind: LayerKind) -> int:
        """Allocatable tokens of the kind's host pool."""
        return self._pages[kind].capacity

    def available(self, kind: LayerKind) -> int:
        return self._pages[kind].available_size()

    def alloc(self, kind: LayerKind, tokens: int) -> torch.Tensor | None:
        """Host slots (int64, CPU) for `tokens` (a whole number of pages); None (nothing
        changed) when the kind's pool is short."""
        P = self.page_size
        assert tokens % P == 0, f"the host tier takes whole pages, got {tokens} tokens"
        pages = self._pages[kind].alloc(tokens // P)
        if pages is None:
            return None
        return page_slots(pages, P)

    def free(self, kind: LayerKind, slots: torch.Tensor) -> None:
        """Give back the pages of these host slots (whole pages, as `alloc` handed out)."""
        if slots.numel():
            self._pages[kind].free(slot_pages(slots, self.page_size).tolist())

    def check_integrity(self) -> None:
        for pages in self._pages.values():
            pages.check_integrity()


class HostKVPool:
    """The host tier's K/V buffers per device pool (see the module docstring)."""

    def __init__(
        self, spec: ModelSpec, plan: HostPlan, layers: dict[LayerKind, int], dtype: torch.dtype,
        *, pin: bool,
    ) -> None:  # fmt: skip
        P = plan.page_size
        self.page_size = P
        self.k: dict[LayerKind, torch.Tensor] = {}
        self.v: dict[LayerKind, torch.Tensor] = {}
        for kind, tokens in ((LayerKind.FULL, plan.full_tokens), (LayerKind.SWA, plan.swa_tokens)):
            n, shape = layers[kind], spec.shape(kind)
            if n == 0:
                continue  # no layer of this kind: the pool is addresses only
            rows = (tokens // P + 1, n, P, shape.num_kv_heads)
            self.k[kind] = torch.zeros(*rows, shape.head_dim, dtype=dtype, pin_memory=pin)
            self.v[kind] = torch.zeros(*rows, shape.v_head_dim, dtype=dtype, pin_memory=pin)

    def nbytes(self) -> int:
        bufs = [*self.k.values(), *self.v.values()]
        return sum(b.numel() * b.element_size() for b in bufs)


def slot_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages of whole-page slot runs (the first slot of each page), in order."""
    return slots[::page_size] // page_size

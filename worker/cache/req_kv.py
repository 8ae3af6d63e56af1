"""Request-side KV state: the scheduler writes it, the cache hooks read it (docs/design.md §8).

Positions are token indices of the request. The ranges, for a radix cache::

    0            cache_protected_len   swa_evicted_seqlen      kv_committed_len  kv_allocated_len
    |--- tree-owned ---|--- request-owned, SWA freed ---|--- request-owned, live ---|- spare -|

While a repair runs, kv_committed_len starts at repair_start < cache_protected_len: the rows
``[repair_start, cache_protected_len)`` are recomputed into scratch slots (docs/design.md §9.8).

The tree owns `[0, cache_protected_len)` (the request's table points at the tree's slots and
its lock keeps them); the request owns the rest. The frontier `swa_evicted_seqlen` only ever
covers request-owned positions (chunk cache: protected is 0, so it covers `[0, frontier)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.events import ROOT_HASH
from core.geometry import ceil_page

if TYPE_CHECKING:
    from worker.cache.base import LockReceipt


def _empty_table() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(slots=True, eq=False)
class ReqKV:
    """One request's KV bookkeeping (identity-compared: it holds a tensor). Only the scheduler
    package writes it (`worker.scheduler.scheduler`: allocation and commits; `kv_state`: what a
    cache hook returns, the window frees): the hooks read it and return a `KVUpdate`."""

    tokens: list[int]  # token ids so far (prompt + output)
    root_hash: int = ROOT_HASH  # its cache salt's: the tree root it inserts under (§9.10)
    table: torch.Tensor = field(default_factory=_empty_table)  # int64, CPU: full slot per position
    cache_protected_len: int = 0  # page-aligned; owned by the tree
    swa_evicted_seqlen: int = 0  # page-aligned frontier: SWA freed below it (request-owned part)
    lock: LockReceipt | None = None  # the locked match / last inserted node
    swa_lock_released: bool = False  # early release done; the lock is FULL-only now
    kv_committed_len: int = 0  # positions whose KV is written and valid
    kv_allocated_len: int = 0  # positions that have a slot in `table`
    swa_evict_floor: int = 0  # positions below it are never window-freed while running
    # A repair in flight (docs/design.md §9.8): positions [repair_start, cache_protected_len) are
    # recomputed into these scratch full slots (int64, CPU; fresh pages paired with private SWA
    # slots, not in the tree). Meanwhile kv_committed_len runs from repair_start up.
    repair_start: int = 0
    repair_slots: torch.Tensor | None = None
    # The request's row of the runner's device page table (docs/design.md §18.1; -1: none) and
    # how many leading positions of that row hold `table` (ForwardReq.synced). Whoever rewrites
    # `table[p]` below `synced_len` lowers it to p (recording an insert's tree slots does).
    row: int = -1
    synced_len: int = 0

    @property
    def repairing(self) -> bool:
        return self.repair_slots is not None

    def _scratch(self) -> int:
        return 0 if self.repair_slots is None else len(self.repair_slots)

    def owned_full_tokens(self, page_size: int) -> int:
        """Full-pool tokens this request holds beyond the tree (docs/design.md §12)."""
        own = ceil_page(self.kv_allocated_len, page_size) - self.cache_protected_len
        return own + self._scratch()

    def owned_swa_tokens(self, page_size: int) -> int:
        """SWA-pool tokens this request holds beyond the tree (docs/design.md §12)."""
        start = max(self.cache_protected_len, self.swa_evicted_seqlen)
        return max(0, ceil_page(self.kv_allocated_len, page_size) - start) + self._scratch()

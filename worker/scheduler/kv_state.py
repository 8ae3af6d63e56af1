"""The scheduler's writes to a running request's `ReqKV` besides allocation and commits (those
are `worker.scheduler.scheduler`'s): with it, the one writer of request state.

- `record`: what a cache hook decided (`KVUpdate`): lock, protected prefix (the table re-pointed
  at the tree's slots), frontier, a repair's scratch gone;
- SWA freeing of running requests, one rule (the frontier, `worker.kv.frontier`): a decoding
  request frees its out-of-window SWA once `swa_eviction_interval` tokens have left the window
  since its last free (`force`: at once, before retracting anyone), and drops the SWA part of its
  prefix lock once the next query no longer reads the cached prefix; a chunk-cache request
  (radix disabled) frees everything out of the window before each chunk;
- `PageRows` and `drop_row`: the rows of the runner's device page table (docs/design.md §18.1),
  one per live `ReqKV`, given back when it is dropped and reused (lowest first) by the next
  admission.
"""

from __future__ import annotations

import heapq

from worker.cache.base import KVUpdate, PrefixCache
from worker.cache.req_kv import ReqKV
from worker.kv.frontier import free_out_of_window
from worker.kv.hybrid_allocator import HybridAllocator
from worker.scheduler.plan import SchedulerLimits


def record(kv: ReqKV, update: KVUpdate) -> None:
    """Write what a cache hook returned into the request's KV state."""
    if update.tree_slots is not None:
        kv.table[kv.cache_protected_len : update.cache_protected_len] = update.tree_slots
        # The device page-table row must be rewritten from here on (docs/design.md §18.1).
        kv.synced_len = min(kv.synced_len, kv.cache_protected_len)
    kv.lock, kv.swa_lock_released = update.lock, update.swa_lock_released
    kv.cache_protected_len = update.cache_protected_len
    kv.swa_evicted_seqlen = update.swa_evicted_seqlen
    if update.repair_done:
        kv.repair_slots = None


def free_decode_window(
    kv: ReqKV,
    allocator: HybridAllocator,
    cache: PrefixCache,
    limits: SchedulerLimits,
    *,
    force: bool = False,
) -> None:
    """Early window-lock release, then the periodic out-of-window free of one decoding request."""
    window = limits.geometry.window
    assert window is not None
    if kv.lock is not None and not kv.swa_lock_released:
        # The next query sits at kv_committed_len and reads keys from kv_committed_len - W on:
        # once that is >= cache_protected_len, the prefix's SWA is no longer read.
        if kv.kv_committed_len - kv.cache_protected_len >= window:
            kv.lock = cache.release_window_lock(kv.lock)
            kv.swa_lock_released = True
    # Per request (not per global step): free once `interval` tokens left the window.
    interval = 1 if force else limits.swa_eviction_interval
    if kv.kv_committed_len - window < kv.swa_evicted_seqlen + interval:
        return
    kv.swa_evicted_seqlen = free_out_of_window(
        allocator,
        kv.table,
        limits.geometry,
        evicted=kv.swa_evicted_seqlen,
        protected=kv.cache_protected_len,
        pre_len=kv.kv_committed_len,
        chunk_cache=not limits.radix,
        floor=kv.swa_evict_floor,
    )


def free_before_chunk(kv: ReqKV, allocator: HybridAllocator, limits: SchedulerLimits) -> None:
    """Chunk cache: nothing is tree-owned, so everything out of the window can go now."""
    if limits.geometry.window is None or not allocator.hybrid:
        return
    kv.swa_evicted_seqlen = free_out_of_window(
        allocator,
        kv.table,
        limits.geometry,
        evicted=kv.swa_evicted_seqlen,
        protected=0,
        pre_len=kv.kv_committed_len,
        chunk_cache=True,
        floor=kv.swa_evict_floor,
    )


class PageRows:
    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def give(self, row: int) -> None:
        heapq.heappush(self._free, row)

    def check(self, held: list[int]) -> None:
        """`held` (the running requests' rows) and the free rows are every row handed out, once."""
        if sorted(held + self._free) != list(range(self._next)) or min(held, default=0) < 0:
            raise AssertionError(
                f"page-table rows: running requests hold {sorted(held)}, free {sorted(self._free)}, "
                f"{self._next} handed out (a row leaked or is shared)"
            )


def drop_row(kv: ReqKV, rows: PageRows) -> None:
    """Give `kv`'s page-table row back (idempotent); its next owner starts unsynced."""
    if kv.row >= 0:
        rows.give(kv.row)
        kv.row, kv.synced_len = -1, 0

"""The scheduler's SWA freeing of running requests: what has slid out of the window goes back.

Two callers, one rule (the frontier, `worker.kv.frontier`):

- a decoding request frees its out-of-window SWA once `swa_eviction_interval` tokens have left the
  window since its last free (`force`: at once, before retracting anyone), and drops the SWA part
  of its prefix lock once the next query no longer reads the cached prefix;
- a chunk-cache request (radix disabled) frees everything out of the window before each chunk.
"""

from __future__ import annotations

from worker.cache.base import PrefixCache
from worker.cache.req_kv import ReqKV
from worker.kv.frontier import free_out_of_window
from worker.kv.hybrid_allocator import HybridAllocator
from worker.scheduler.plan import SchedulerLimits


def free_decode_window(
    kv: ReqKV,
    allocator: HybridAllocator,
    cache: PrefixCache,
    limits: SchedulerLimits,
    *,
    force: bool = False,
) -> None:
    """Early window-lock release, then the periodic out-of-window free of one decoding request."""
    window = limits.window
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
        evicted=kv.swa_evicted_seqlen,
        protected=kv.cache_protected_len,
        pre_len=kv.kv_committed_len,
        window=window,
        page_size=limits.page_size,
        chunk_cache=not limits.radix,
        floor=kv.swa_evict_floor,
    )


def free_before_chunk(kv: ReqKV, allocator: HybridAllocator, limits: SchedulerLimits) -> None:
    """Chunk cache: nothing is tree-owned, so everything out of the window can go now."""
    window = limits.window
    if window is None or not allocator.hybrid:
        return
    kv.swa_evicted_seqlen = free_out_of_window(
        allocator,
        kv.table,
        evicted=kv.swa_evicted_seqlen,
        protected=0,
        pre_len=kv.kv_committed_len,
        window=window,
        page_size=limits.page_size,
        chunk_cache=True,
        floor=kv.swa_evict_floor,
    )

"""KV memory of one device: the paired full/SWA allocators, the KV pools, the SWA frontier."""

from __future__ import annotations

from worker.kv.allocator import PageAllocator
from worker.kv.frontier import free_out_of_window, swa_frontier
from worker.kv.hybrid_allocator import AllocatorSnapshot, HybridAllocator
from worker.kv.pool import HybridKVPool, check_swa_pool_fits

__all__ = [
    "AllocatorSnapshot",
    "HybridAllocator",
    "HybridKVPool",
    "PageAllocator",
    "check_swa_pool_fits",
    "free_out_of_window",
    "swa_frontier",
]

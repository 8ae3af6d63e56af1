"""KV memory of one device: the paired full/SWA allocators, the KV pools, the SWA frontier."""

from worker.mem.allocator import AllocatorSnapshot, HybridAllocator
from worker.mem.frontier import free_out_of_window, swa_frontier
from worker.mem.page_allocator import PageAllocator
from worker.mem.pool import HybridKVPool, check_swa_pool_fits

__all__ = [
    "AllocatorSnapshot",
    "HybridAllocator",
    "HybridKVPool",
    "PageAllocator",
    "check_swa_pool_fits",
    "free_out_of_window",
    "swa_frontier",
]

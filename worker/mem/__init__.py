"""KV memory of one device: the paired full/SWA allocators, the KV pools, the SWA frontier."""

from worker.mem.allocator import AllocatorSnapshot, HybridAllocator
from worker.mem.page_allocator import PageAllocator

__all__ = ["AllocatorSnapshot", "HybridAllocator", "PageAllocator"]

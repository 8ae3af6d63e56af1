"""KV memory of one device: the paired full/SWA allocators, the KV pools, the SWA frontier.

The names load lazily, so `worker.kv.pages` (the page rounding the router's repair rule uses,
through `worker.cache.reuse`) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.kv.allocator import PageAllocator
    from worker.kv.frontier import free_out_of_window, swa_frontier
    from worker.kv.hybrid_allocator import AllocatorSnapshot, HybridAllocator
    from worker.kv.pool import HybridKVPool, check_swa_pool_fits

_EXPORTS = {
    "AllocatorSnapshot": "worker.kv.hybrid_allocator",
    "HybridAllocator": "worker.kv.hybrid_allocator",
    "HybridKVPool": "worker.kv.pool",
    "PageAllocator": "worker.kv.allocator",
    "check_swa_pool_fits": "worker.kv.pool",
    "free_out_of_window": "worker.kv.frontier",
    "swa_frontier": "worker.kv.frontier",
}

__all__ = [
    "AllocatorSnapshot",
    "HybridAllocator",
    "HybridKVPool",
    "PageAllocator",
    "check_swa_pool_fits",
    "free_out_of_window",
    "swa_frontier",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'worker.kv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""Prefix caches over the hybrid allocator: the unified radix cache and the chunk cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.cache.base import EvictResult, LockReceipt, MatchResult, PrefixCache
from worker.cache.req_kv import ReqKV

if TYPE_CHECKING:
    from worker.mem.allocator import HybridAllocator


def create_cache(
    allocator: HybridAllocator,
    window: int | None,
    *,
    enable_radix_cache: bool = True,
    eager_swa_free: bool = False,
) -> PrefixCache:
    """The cache the engine config asks for (implementations import lazily)."""
    if enable_radix_cache:
        from worker.cache.radix_cache import RadixCache

        return RadixCache(allocator, window, eager_swa_free=eager_swa_free)
    from worker.cache.chunk_cache import ChunkCache

    return ChunkCache(allocator, window)


__all__ = ["EvictResult", "LockReceipt", "MatchResult", "PrefixCache", "ReqKV", "create_cache"]

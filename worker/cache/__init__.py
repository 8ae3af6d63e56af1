"""Prefix caches over the hybrid allocator: the unified radix cache and the chunk cache
(`create_cache` picks one; the implementations load when asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.geometry import Geometry
    from worker.cache.base import PrefixCache
    from worker.cache.host_tier import HostTier
    from worker.kv.hybrid_allocator import HybridAllocator


def create_cache(
    allocator: HybridAllocator,
    geometry: Geometry,
    *,
    enable_radix_cache: bool = True,
    eager_swa_free: bool = False,
    swa_eviction_policy: str = "tail_first",
    tier: HostTier | None = None,
) -> PrefixCache:
    """The cache the engine config asks for over `allocator` (implementations import lazily);
    `geometry`: page size, the window the cache applies (None without a separate SWA pool);
    `tier`: the host tier (radix cache only)."""
    if enable_radix_cache:
        from worker.cache.radix_cache import RadixCache

        return RadixCache(
            allocator,
            geometry,
            eager_swa_free=eager_swa_free,
            swa_eviction_policy=swa_eviction_policy,
            tier=tier,
        )
    assert tier is None, "the host tier holds what a radix cache evicts"
    from worker.cache.chunk_cache import ChunkCache

    return ChunkCache(allocator, geometry)


__all__ = ["create_cache"]

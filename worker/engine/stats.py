"""Pool gauges and counters for `Engine.stats()` (the Prometheus endpoint reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.cache.base import PrefixCache
from worker.kv.hybrid_allocator import HybridAllocator
from worker.outputs import EngineStats, PoolStats


@dataclass
class PoolPeaks:
    """Maximum `used` (= total − free − evictable) seen per pool since start."""

    full: int = 0
    swa: int = 0

    def observe(self, allocator: HybridAllocator, cache: PrefixCache) -> None:
        self.full = max(self.full, _used(allocator.full_size, allocator.full_available_size(), cache.full_evictable))
        if allocator.hybrid:
            self.swa = max(self.swa, _used(allocator.swa_size, allocator.swa_available_size(), cache.swa_evictable))


def _used(total: int, free: int, evictable: int) -> int:
    return total - free - evictable


def tombstone_tokens(allocator: HybridAllocator, cache: PrefixCache) -> int:
    """Cached tokens whose SWA KV was freed (full KV kept): every cached token counts in the
    full sizes, only those with live SWA in the SWA sizes."""
    if not allocator.hybrid:
        return 0
    cached = cache.full_evictable + cache.full_protected
    return cached - cache.swa_evictable - cache.swa_protected


def pool_stats(allocator: HybridAllocator, cache: PrefixCache, peaks: PoolPeaks) -> tuple[PoolStats, PoolStats]:
    a = allocator
    full = PoolStats(a.full_size, a.full_available_size(), cache.full_evictable,
                     _used(a.full_size, a.full_available_size(), cache.full_evictable), peaks.full)  # fmt: skip
    if not a.hybrid:
        return full, full
    swa = PoolStats(a.swa_size, a.swa_available_size(), cache.swa_evictable,
                    _used(a.swa_size, a.swa_available_size(), cache.swa_evictable), peaks.swa)  # fmt: skip
    return full, swa


def engine_stats(
    allocator: HybridAllocator,
    cache: PrefixCache,
    peaks: PoolPeaks,
    waiting: int,
    running: int,
    counters: dict[str, float],
    last_step_seconds: float,
) -> EngineStats:
    full, swa = pool_stats(allocator, cache, peaks)
    c = {k: int(v) for k, v in counters.items()}
    return EngineStats(
        full=full,
        swa=swa,
        hybrid=allocator.hybrid,
        waiting=waiting,
        running=running,
        cache_hit_tokens=c["cache_hit_tokens"],
        prompt_tokens=c["prompt_tokens"],
        generated_tokens=c["generated_tokens"],
        full_evicted_tokens=c["full_evicted_tokens"],
        swa_evicted_tokens=c["swa_evicted_tokens"],
        tombstone_tokens=tombstone_tokens(allocator, cache),
        retractions=c["retractions"],
        aborts=c["aborts"],
        steps=c["steps"],
        last_step_seconds=last_step_seconds,
        queued_prefill_tokens=c.get("queued_prefill_tokens", 0),
        running_decodes=c.get("running_decodes", 0),
    )

"""`EngineStats` snapshots: built on the step thread after each step, read from any thread.

The step thread owns the pools, the cache and the scheduler; nothing else may iterate them. It
publishes a frozen `EngineStats` after every step (and after a flush), and every other thread
(the replica's event loop, `/metrics`, the router's load signal) reads only that snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.outputs import EngineStats, PoolStats, TierStats
from worker.assembly.host import HostParts
from worker.cache.base import PrefixCache
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.transfer import Move
from worker.models.spec import LayerKind
from worker.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counts of the engine loop itself (the scheduler keeps its own)."""

    steps: int = 0  # steps that ran a forward
    generated_tokens: int = 0


@dataclass
class PoolPeaks:
    """Maximum `used` (= total − free − evictable) seen per pool since start."""

    full: int = 0
    swa: int = 0

    def observe(self, allocator: HybridAllocator, cache: PrefixCache) -> None:
        a = allocator
        self.full = max(self.full, a.full_size - a.full_available_size() - cache.full_evictable)
        if a.hybrid:
            self.swa = max(self.swa, a.swa_size - a.swa_available_size() - cache.swa_evictable)


def _pool(total: int, free: int, evictable: int, peak: int) -> PoolStats:
    return PoolStats(total, free, evictable, total - free - evictable, peak)


def tombstone_tokens(allocator: HybridAllocator, cache: PrefixCache) -> int:
    """Cached tokens whose SWA KV was freed (full KV kept): every cached token counts in the
    full sizes, only those with live SWA in the SWA sizes."""
    if not allocator.hybrid:
        return 0
    cached = cache.full_evictable + cache.full_protected
    return cached - cache.swa_evictable - cache.swa_protected


def host_stats(host: HostParts | None) -> dict[str, object]:
    """The host tier's part of `EngineStats` (nothing without a tier: the defaults)."""
    if host is None:
        return {}
    tier, moved = host.tier, host.tier.queue.moved
    pools = {}
    for kind, name in ((LayerKind.FULL, "host_full"), (LayerKind.SWA, "host_swa")):
        size = tier.host.size(kind)
        pools[name] = TierStats(size, size - tier.host.available(kind))

    def nbytes(move: Move) -> int:
        return int(sum(moved[move, k] * host.bytes_per_token(k) for k in LayerKind))

    return pools | dict(
        loaded_tokens=tier.tokens_loaded,
        loaded_full_tokens=moved[Move.LOAD, LayerKind.FULL],
        loaded_swa_tokens=moved[Move.LOAD, LayerKind.SWA],
        loaded_bytes=nbytes(Move.LOAD),
        offloaded_tokens=tier.tokens_offloaded,
        offloaded_bytes=nbytes(Move.OFFLOAD),
    )


def snapshot(
    scheduler: Scheduler,
    peaks: PoolPeaks,
    counters: EngineCounters,
    last_step_seconds: float,
    host: HostParts | None = None,
) -> EngineStats:
    """Everything `Engine.stats()` reports, copied out of the live state (step thread only)."""
    a, c, s = scheduler.allocator, scheduler.cache, scheduler.counters
    full = _pool(a.full_size, a.full_available_size(), c.full_evictable, peaks.full)
    swa = full
    if a.hybrid:
        swa = _pool(a.swa_size, a.swa_available_size(), c.swa_evictable, peaks.swa)
    return EngineStats(
        full=full,
        swa=swa,
        hybrid=a.hybrid,
        waiting=len(scheduler.waiting),
        running=len(scheduler.running),
        # Prompt tokens still to compute: waiting requests plus unfinished chunked prefills.
        queued_prefill_tokens=sum(r.remaining for r in scheduler.waiting)
        + sum(r.remaining for r in scheduler.running if not r.is_decoding),
        running_decodes=sum(1 for r in scheduler.running if r.is_decoding),
        cache_hit_tokens=s.cache_hit_tokens,
        repairs=s.repairs,
        repaired_tokens=s.repaired_tokens,
        prompt_tokens=s.finished_prompt_tokens,
        generated_tokens=counters.generated_tokens,
        full_evicted_tokens=s.full_evicted_tokens,
        swa_evicted_tokens=s.swa_evicted_tokens,
        tombstone_tokens=tombstone_tokens(a, c),
        retractions=s.retractions,
        aborts=s.aborts,
        steps=counters.steps,
        last_step_seconds=last_step_seconds,
        **host_stats(host),  # type: ignore[arg-type]
    )

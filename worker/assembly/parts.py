"""`EngineParts`: everything an `Engine` is built from. `build_engine_parts`
(`worker/assembly/builder.py`) makes them from a config; tests and benchmarks build them by hand
around a fake or compute-free runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.geometry import Geometry
from core.reuse import TierCosts
from worker.assembly.host import HostParts
from worker.assembly.ranks import TensorParallel
from worker.cache import create_cache
from worker.cache.base import PrefixCache
from worker.cache.host_tier import HostTier
from worker.config import EngineConfig
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import PoolPlan
from worker.models.model_dir import Tokenizer
from worker.models.spec import ModelSpec
from worker.runner.base import Runner


@dataclass
class EngineParts:
    spec: ModelSpec
    allocator: HybridAllocator
    cache: PrefixCache
    runner: Runner  # a ModelRunner, or a compute-free one (worker/runner/standin.py)
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_loader: Callable[[], Tokenizer] | None = None
    model_dir: Path | None = None
    plan: PoolPlan | None = None  # with tensor parallelism: one rank's pools
    tp: TensorParallel | None = None  # the other ranks (tensor_parallel_size > 1)
    host: HostParts | None = None  # the host KV tier (docs/design.md §9.9)

    @property
    def tier_costs(self) -> TierCosts | None:
        """What a token costs to prefill or load here (None: no host tier)."""
        return None if self.host is None else self.host.costs

    @property
    def cache_window(self) -> int | None:
        """The window the cache and scheduler budget with: None without a separate SWA pool."""
        return self.spec.window if self.allocator.hybrid else None

    @property
    def geometry(self) -> Geometry:
        """What the cache and the scheduler's reuse rules see of the pools (`cache_geometry`)."""
        return cache_geometry(self.spec, self.allocator)


def cache_geometry(spec: ModelSpec, allocator: HybridAllocator) -> Geometry:
    """Page size, the window (None without a separate SWA pool: nothing is ever tombstoned)
    and the model's SWA layer count."""
    window = spec.window if allocator.hybrid else None
    return Geometry(allocator.page_size, window, len(spec.swa_layer_ids))


def configured_cache(
    config: EngineConfig, spec: ModelSpec, allocator: HybridAllocator, tier: HostTier | None = None
) -> PrefixCache:
    """The prefix cache `config` asks for over `allocator` (and the host tier, if any)."""
    return create_cache(
        allocator,
        cache_geometry(spec, allocator),
        enable_radix_cache=config.enable_radix_cache,
        eager_swa_free=config.eager_swa_free,
        swa_eviction_policy=config.swa_eviction_policy,
        tier=tier,
    )

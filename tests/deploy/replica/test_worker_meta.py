"""What a worker replica tells the cache index about itself (`WorkerMeta`): its geometry, pools,
repair rule and, with a host tier, the tier's costs and full capacity (docs/design.md §4.3)."""

from __future__ import annotations

import dataclasses
from typing import cast

from core.outputs import PoolStats
from core.reuse import TierCosts
from deploy.replica.events import CacheEventPump
from tests.fakes.fake_engine import FakeEngine
from worker.config import EngineConfig
from worker.engine.protocols import EngineClient

COSTS = TierCosts(prefill=2e-5, load_full=7e-7, load_swa=7e-7)


def _pump(engine: FakeEngine) -> CacheEventPump:
    return CacheEventPump(cast(EngineClient, engine), "w1", "app", "Worker")


def test_meta_without_a_host_tier() -> None:
    """An engine without a tier: no costs, no host capacity (the router reuses device KV only)."""
    meta = _pump(FakeEngine(EngineConfig(page_size=4, max_model_len=64)))._meta()
    assert meta.tier_costs is None and meta.host_full_tokens == 0
    assert meta.geometry.page_size == 4 and meta.full_tokens == 4096


def test_meta_carries_the_tier_costs_and_host_capacity() -> None:
    """The engine's `tier_costs` and its host tier's full size reach the index."""
    engine = FakeEngine(EngineConfig(page_size=4, max_model_len=64))
    engine.tier_costs = COSTS  # type: ignore[attr-defined]  # what a tiered engine exposes
    stats = engine.stats
    engine.stats = lambda: dataclasses.replace(stats(), host_full=PoolStats(16384, 16384, 0, 0, 0))  # type: ignore[method-assign]
    meta = _pump(engine)._meta()
    assert meta.tier_costs == COSTS and meta.host_full_tokens == 16384

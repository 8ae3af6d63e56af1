"""Cost model pieces: pool needs per kind, load, the imbalance guard, in-flight accounting."""

from __future__ import annotations

import pytest

from cluster.messages import PoolHeadroom, WorkerLoad
from core.geometry import Geometry
from router.cost import (
    CostWeights,
    WorkerView,
    capacity_tokens,
    load_tokens,
    overloaded,
    request_cost,
)
from router.inflight import InflightTracker

W = CostWeights()


def _view(full: PoolHeadroom, swa: PoolHeadroom, *, hybrid: bool = True, **kw: int) -> WorkerView:
    load = WorkerLoad("w", 0.0, 0, kw.pop("queued", 0), kw.pop("decodes", 0), full, swa)
    return WorkerView(
        "w", 0, 0, load, geometry=Geometry(16, kw.pop("window", 64)), hybrid=hybrid, **kw
    )


def test_swa_pool_counts_only_on_hybrid_workers() -> None:
    """A tiny SWA pool costs a hybrid worker a shortfall; a non-hybrid worker ignores it."""
    roomy, tiny = PoolHeadroom(10_000, 0, 10_000), PoolHeadroom(10, 0, 10_000)
    assert capacity_tokens(_view(roomy, roomy), 100, 0, W) == 0
    # SWA need = max(uncached, window) + page = 116; 10 free → 106 short
    assert capacity_tokens(_view(roomy, tiny), 100, 0, W) == W.shortfall * 106
    assert capacity_tokens(_view(roomy, tiny, hybrid=False), 100, 0, W) == 0


def test_eviction_cheaper_than_shortfall() -> None:
    """Fitting by evicting cached KV costs eviction weight; not fitting at all costs more."""
    evictable = PoolHeadroom(0, 1000, 1000)
    roomy = PoolHeadroom(10_000, 0, 10_000)
    assert capacity_tokens(_view(evictable, roomy), 100, 20, W) == W.eviction * 120
    assert capacity_tokens(_view(PoolHeadroom(0, 50, 50), roomy), 100, 0, W) == (
        W.shortfall * 50 + W.eviction * 50
    )


def test_extra_prefill_claims_capacity_and_load() -> None:
    """Requests this router just sent count as queued prefill and as used slots."""
    pool = PoolHeadroom(200, 0, 1000)
    view = _view(pool, pool, hybrid=False, extra_prefill_tokens=150, extra_requests=1)
    assert load_tokens(view, W) == 150 + W.decode
    assert capacity_tokens(view, 100, 0, W) == W.shortfall * 50


def test_cost_credits_cached_tokens() -> None:
    """Each cached token saves one prefill token of cost."""
    pool = PoolHeadroom(10_000, 0, 10_000)
    view = _view(pool, pool, queued=30, decodes=2)
    assert request_cost(view, 0, 500, 0, W) - request_cost(view, 200, 500, 0, W) == 200
    assert request_cost(view, 500, 500, 0, W) == 30 + 2 * W.decode


def test_imbalance_guard_needs_both_thresholds() -> None:
    """Only a load both far above (absolute) and a multiple of (relative) the lightest trips."""
    w = CostWeights(imbalance_abs_tokens=100, imbalance_rel=2.0)
    assert overloaded([0.0, 101.0, 100.0], w) == [False, True, False]
    assert overloaded([1000.0, 1500.0], w) == [False, False]  # 500 above, but < 2×


def test_negative_weight_rejected() -> None:
    """Weights must be non-negative, and the error names the field."""
    with pytest.raises(ValueError, match="decode"):
        CostWeights(decode=-1)


def test_inflight_bounded_and_retried_key_moves() -> None:
    """A retried request moves between workers; per-worker records are bounded."""
    t = InflightTracker(max_per_worker=2)
    t.record("r1", "a", 10, at=1.0)
    t.record("r1", "b", 10, at=2.0)
    assert t.unsampled("a", None) == (0, 0) and t.unsampled("b", None) == (10, 1)
    for i in range(5):
        t.record(f"x{i}", "c", 1, at=3.0 + i)
    assert t.unsampled("c", None) == (2, 2)
    assert t.unsampled("c", 6.5) == (1, 1)  # the sample at 6.5 includes x3
    t.forget_worker("c")
    assert t.unsampled("c", None) == (0, 0)


def test_loads_take_device_slots_and_cost_their_copy() -> None:
    """A load brings KV back into both device pools (full: its loaded_full, SWA: its
    loaded_swa) and costs its copy in tokens of prefill."""
    tight = PoolHeadroom(100, 0, 10_000)
    roomy = PoolHeadroom(10_000, 0, 10_000)
    view = _view(tight, roomy, loaded_full=64, loaded_swa=16)
    assert capacity_tokens(view, 50, 0, W) == W.shortfall * (50 + 64 - 100)
    swa_tight = _view(roomy, PoolHeadroom(80, 0, 10_000), loaded_full=64, loaded_swa=16)
    assert capacity_tokens(swa_tight, 50, 0, W) == W.shortfall * (64 + 16 + 16 - 80)  # window + page + loaded
    assert request_cost(_view(roomy, roomy), 100, 500, 0, W, host_load=12.5) - request_cost(
        _view(roomy, roomy), 100, 500, 0, W
    ) == W.prefill * 12.5

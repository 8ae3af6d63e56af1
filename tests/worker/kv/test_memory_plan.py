"""plan_pools (docs/design.md §6.1): SGLang's pool-configurator numbers and MiMo shapes."""

from __future__ import annotations

import logging

import pytest

from worker.errors import ConfigError
from worker.kv.memory_plan import (
    LOGPROB_ROW_BYTES,
    LOGPROB_SHARE,
    ChunkCap,
    PoolPlan,
    kv_share_of,
    plan_logprob_rows,
    plan_pools,
)
from worker.models.spec import KindShape, LayerKind, ModelSpec

GIB = 1024**3


def _spec(n_full: int, n_swa: int, window: int | None = 8, swa_kv: int = 2) -> ModelSpec:
    kinds = (LayerKind.FULL,) * n_full + (LayerKind.SWA,) * n_swa
    return ModelSpec(
        architecture="test",
        layer_kinds=kinds,
        window=window if n_swa else None,
        full=KindShape(num_q_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16),
        swa=KindShape(num_q_heads=4, num_kv_heads=swa_kv, head_dim=16, v_head_dim=16),
        vocab_size=128,
        hidden_size=64,
        max_position_embeddings=4096,
    )


def _bytes(spec: ModelSpec, plan: PoolPlan, dtype_bytes: int = 2) -> int:
    f = spec.kind_bytes_per_token(LayerKind.FULL, dtype_bytes)
    s = spec.kind_bytes_per_token(LayerKind.SWA, dtype_bytes)
    return plan.full_tokens * f + (plan.swa_tokens if plan.hybrid else plan.full_tokens) * s


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 1.0])
def test_ratio_split_fills_the_budget_and_keeps_the_ratio(ratio: float) -> None:
    """P=1: memory used <= budget and > 99 % of it; swa == int(full * ratio); max_total == full."""
    spec, budget = _spec(4, 4), 10**8
    plan = plan_pools(
        spec, page_size=1, dtype_bytes=2, swa_full_tokens_ratio=ratio, kv_cache_bytes=budget
    )
    assert plan.swa_tokens == int(plan.full_tokens * ratio)
    assert 0.99 * budget < plan.total_bytes == _bytes(spec, plan) <= budget
    assert plan.max_total_tokens == plan.full_tokens and plan.hybrid


def test_page_alignment_with_p128() -> None:
    """P=128: both pools page multiples and swa == floor_128(int(full * 0.5))."""
    plan = plan_pools(
        _spec(4, 4), page_size=128, dtype_bytes=2, swa_full_tokens_ratio=0.5, kv_cache_bytes=10**8
    )
    assert plan.full_tokens % 128 == 0 and plan.swa_tokens % 128 == 0
    assert plan.swa_tokens == (int(plan.full_tokens * 0.5) // 128) * 128


def test_max_total_tokens_path_splits_the_constraint() -> None:
    """Ratio 0.5, constraint 200 -> (200, 100); a constraint of half the tokens uses ~half the bytes."""
    spec = _spec(4, 4)
    plan = plan_pools(
        spec, page_size=1, dtype_bytes=2, swa_full_tokens_ratio=0.5, max_total_tokens=200
    )
    assert (plan.full_tokens, plan.swa_tokens) == (200, 100)
    free = plan_pools(
        spec, page_size=1, dtype_bytes=2, swa_full_tokens_ratio=0.5, kv_cache_bytes=10**8
    )
    half = plan_pools(
        spec, page_size=1, dtype_bytes=2, swa_full_tokens_ratio=0.5,
        kv_cache_bytes=10**8, max_total_tokens=free.full_tokens // 2,
    )  # fmt: skip
    assert half.total_bytes == pytest.approx(free.total_bytes / 2, rel=1e-3)


def test_asymmetric_layer_counts() -> None:
    """24 full + 8 SWA layers: the cell formula F*Lf + r*S*Ls sizes the full pool."""
    spec, budget = _spec(24, 8), 10**9
    plan = plan_pools(
        spec, page_size=16, dtype_bytes=2, swa_full_tokens_ratio=0.8, kv_cache_bytes=budget
    )
    cell = 24 * 128 + 0.8 * 8 * 128  # per-layer K+V: 2 heads * 32 elems * 2 bytes = 128
    assert plan.full_tokens == (int(budget // cell) // 16) * 16
    assert plan.swa_tokens == (int(plan.full_tokens * 0.8) // 16) * 16


def test_all_swa_ignores_the_ratio() -> None:
    """All-SWA: full 0, max_total == swa == floor_P(B // S); constraint 500 -> 500."""
    spec = _spec(0, 4)
    plan = plan_pools(
        spec, page_size=4, dtype_bytes=2, swa_full_tokens_ratio=0.3, kv_cache_bytes=10**6
    )
    assert plan.full_tokens == 0 and plan.max_total_tokens == plan.swa_tokens
    assert plan.swa_tokens == (10**6 // (4 * 128)) // 4 * 4
    capped = plan_pools(spec, page_size=1, dtype_bytes=2, max_total_tokens=500)
    assert (capped.full_tokens, capped.swa_tokens, capped.max_total_tokens) == (0, 500, 500)


def test_disable_hybrid_gives_one_pool_for_all_layers() -> None:
    """disable_hybrid_swa_memory: one pool of N tokens, hybrid False, swa == full, N = B // (F + S)."""
    spec, budget = _spec(2, 6), 10**7
    plan = plan_pools(
        spec, page_size=16, dtype_bytes=2, kv_cache_bytes=budget, disable_hybrid_swa_memory=True
    )
    assert not plan.hybrid and plan.swa_tokens == plan.full_tokens
    assert plan.full_tokens == (budget // (8 * 128)) // 16 * 16
    assert plan.total_bytes == _bytes(spec, plan) <= budget


def test_model_without_swa_is_not_hybrid() -> None:
    """No SWA layers: one pool, hybrid False, no SWA bytes."""
    plan = plan_pools(_spec(4, 0), page_size=16, dtype_bytes=2, kv_cache_bytes=10**7)
    assert not plan.hybrid and plan.swa_bytes == 0 and plan.full_tokens == (10**7 // 512) // 16 * 16


def test_chunk_cap_sizes_swa_for_the_worst_case() -> None:
    """W=8, P=4, interval 4, chunk 16, 2 requests, overlap -> SWA 76; without overlap 60."""
    spec, budget = _spec(4, 4, window=8), 10**6
    cap = ChunkCap(
        max_running_requests=2, chunked_prefill_size=16, swa_eviction_interval=4, overlap=True
    )
    plan = plan_pools(spec, page_size=4, dtype_bytes=2, kv_cache_bytes=budget, chunk_cap=cap)
    assert plan.swa_tokens == 76
    assert plan.full_tokens == ((budget - 76 * 512) // 512) // 4 * 4  # the rest goes to full
    assert ChunkCap(2, 16, 4, overlap=False).swa_tokens(window=8, page_size=4) == 60


def test_chunk_cap_constraint_path() -> None:
    """Constraint path: full = floor_P(constraint), swa = min(ceil_P(cap), constraint)."""
    cap = ChunkCap(
        max_running_requests=2, chunked_prefill_size=16, swa_eviction_interval=4, overlap=True
    )
    plan = plan_pools(_spec(4, 4), page_size=4, dtype_bytes=2, max_total_tokens=202, chunk_cap=cap)
    assert (plan.full_tokens, plan.swa_tokens) == (200, 76)


def test_plan_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """describe() goes to the log at INFO with both pool sizes."""
    with caplog.at_level(logging.INFO, logger="worker.kv.memory_plan"):
        plan = plan_pools(
            _spec(4, 4), page_size=1, dtype_bytes=2, swa_full_tokens_ratio=0.5, max_total_tokens=200
        )
    assert "full_layer_tokens=200 swa_layer_tokens=100" in caplog.text
    assert plan.describe().startswith("full_layer_tokens=200 swa_layer_tokens=100")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(swa_full_tokens_ratio=0.0, kv_cache_bytes=10**6), r"in \(0, 1\]"),
        (dict(swa_full_tokens_ratio=1.5, kv_cache_bytes=10**6), r"in \(0, 1\]"),
        (dict(page_size=3, kv_cache_bytes=10**6), "power of two"),
        (dict(), "kv_cache_bytes .* or max_total_tokens"),
        (dict(kv_cache_bytes=100), "raise kv_cache_bytes"),
    ],
)
def test_bad_inputs_say_what_to_change(kwargs: dict, match: str) -> None:
    """Ratio outside (0, 1], non power-of-two pages, no budget, a budget without one page."""
    args = dict(page_size=4, dtype_bytes=2) | kwargs
    with pytest.raises(ConfigError, match=match):
        plan_pools(_spec(4, 4), **args)


def test_swa_pool_below_the_admission_floor_refuses_to_start() -> None:
    """SWA pool <= window + page_size: the error names both numbers and what to raise."""
    spec = _spec(4, 4, window=100)
    with pytest.raises(
        ConfigError, match=r"holds 48 tokens .* = 100 \+ 16 = 116 .*swa_full_tokens_ratio"
    ):
        plan_pools(
            spec, page_size=16, dtype_bytes=2, swa_full_tokens_ratio=0.25, max_total_tokens=200
        )
    ok = plan_pools(
        spec, page_size=16, dtype_bytes=2, swa_full_tokens_ratio=1.0, max_total_tokens=200
    )
    assert ok.swa_tokens == 192


# ---------------------------------------------------------------- MiMo-V2-Flash shapes

MIMO_FULL_IDS = (0, 5, 11, 17, 23, 29, 35, 41, 47)


def _mimo() -> ModelSpec:
    kinds = tuple(LayerKind.FULL if i in MIMO_FULL_IDS else LayerKind.SWA for i in range(48))
    return ModelSpec(
        architecture="mimo_v2_flash",
        layer_kinds=kinds,
        window=128,
        full=KindShape(64, 4, 192, 128, has_sinks=False),
        swa=KindShape(64, 8, 192, 128, has_sinks=True),
        vocab_size=152576,
        hidden_size=4096,
        max_position_embeddings=262144,
    )


def test_mimo_default_ratio_gives_swa_most_of_the_bytes() -> None:
    """r = 0.8: the SWA pool takes ~87 % of the KV bytes (39 SWA layers x 8 KV heads vs 9 x 4)."""
    plan = plan_pools(
        _mimo(), page_size=16, dtype_bytes=2, swa_full_tokens_ratio=0.8, kv_cache_bytes=80 * GIB
    )
    share = plan.swa_bytes / plan.total_bytes
    assert share == pytest.approx(0.8 * 199680 / (23040 + 0.8 * 199680), abs=1e-3)
    assert 0.86 < share < 0.88


def test_mimo_small_ratio_multiplies_full_capacity() -> None:
    """r = 0.05: the full pool holds ~6.7x the tokens of one pool for all layers.

    NOTE: the brief expected ~5.5x; with the real shapes (F = 9 x 2560, S = 39 x 5120 bytes per
    token) it is (F + S) / (F + 0.05 S) = 222720 / 33024 = 6.74. 5.5x needs r ~= 0.085.
    """
    kw = dict(page_size=16, dtype_bytes=2, kv_cache_bytes=80 * GIB)
    dual = plan_pools(_mimo(), swa_full_tokens_ratio=0.05, **kw)
    single = plan_pools(_mimo(), disable_hybrid_swa_memory=True, **kw)
    assert dual.full_tokens / single.full_tokens == pytest.approx(222720 / 33024, rel=2e-3)
    assert dual.swa_tokens > 128 + 16


def test_prompt_logprob_rows_fit_their_share_of_the_kv_pools() -> None:
    """An 8K chunk over a 200K vocabulary would need ~13 GB of logits at once; the workspace is
    1/32 of the pools (~3 GiB of 100 GiB): ~1,000 rows a piece, never more bytes than that."""
    plan = plan_logprob_rows(100 * GIB, 200_000)
    assert plan.rows == 100 * GIB // LOGPROB_SHARE // (200_000 * LOGPROB_ROW_BYTES) == 1048
    assert plan.bytes == plan.rows * 200_000 * LOGPROB_ROW_BYTES <= 100 * GIB // LOGPROB_SHARE
    assert plan_logprob_rows(1 << 20, 262_144).rows == 1  # one row at least, whatever the vocab


@pytest.mark.parametrize("budget", [10**6, 80 * GIB, 80 * GIB + 17])
def test_a_shared_budget_holds_the_pools_and_their_workspace(budget: int) -> None:
    """CUDA's default budget is split: pools + their 1/32 workspace never exceed it."""
    kv = kv_share_of(budget)
    assert kv + kv // LOGPROB_SHARE <= budget < kv + kv // LOGPROB_SHARE + LOGPROB_SHARE + 2

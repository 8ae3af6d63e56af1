"""The model of admission behind `swaserve bench memory`: the real memory plan
(`worker.kv.memory_plan`) for the dual pools across `swa_full_tokens_ratio` and for one pool
(`disable_hybrid_swa_memory`), and how many concurrent requests of context length C the admission
charges of `worker.scheduler.budget` let in:

    full pool:   ceil_P(C) + P per request                       (full_admission_charge(C, 0, P))
    SWA pool:    min(W + interval + P, ceil_P(C) + P)            (steady_swa_per_request; a request
                                                                  never holds more than its tokens)
    one pool:    ceil_P(C) + P per request, every layer keeps every token

    admitted(dual)   = min(full_tokens // full charge, swa_tokens // SWA hold)
    admitted(single) = tokens // (ceil_P(C) + P)

"shared" is what one shared pool without a fixed ratio could admit (each request holds exactly
its full tokens and its SWA hold; vLLM's hybrid allocator is of this kind): B // bytes per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.geometry import ceil_page
from worker.errors import ConfigError
from worker.kv.frontier import steady_swa_per_request
from worker.kv.memory_plan import PoolPlan, plan_pools
from worker.models.spec import LayerKind, ModelSpec
from worker.scheduler.budget import full_admission_charge

GIB = 1024**3


@dataclass(frozen=True)
class MemorySettings:
    budgets_gib: tuple[float, ...] = (40.0, 80.0)
    ratios: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0)
    contexts: tuple[int, ...] = (2048, 8192, 32768, 131072)
    page_size: int = 16
    dtype_bytes: int = 2  # bf16 KV
    swa_eviction_interval: int = 128


@dataclass(frozen=True)
class PoolPoint:
    """One memory plan and the requests it admits per context length."""

    ratio: float | None  # None: one pool (disable_hybrid_swa_memory)
    full_tokens: int
    swa_tokens: int
    total_bytes: int
    admitted: dict[int, int]
    error: str | None = None  # the ConfigError when the plan cannot start (SWA floor)


@dataclass(frozen=True)
class BudgetResult:
    budget_gib: float
    single: PoolPoint
    dual: tuple[PoolPoint, ...]
    shared_admitted: dict[int, int]


@dataclass(frozen=True)
class ModelResult:
    name: str
    architecture: str
    full_layers: int
    swa_layers: int
    window: int | None
    full_bytes_per_token: int  # over all full layers
    swa_bytes_per_token: int  # over all SWA layers
    budgets: tuple[BudgetResult, ...]


# ---------------------------------------------------------------- the model of admission


def per_request(spec: ModelSpec, context: int, s: MemorySettings) -> tuple[int, int]:
    """(full-pool charge, SWA-pool hold) of one request of `context` tokens."""
    full = full_admission_charge(context, 0, s.page_size)
    if spec.window is None:
        return full, 0
    steady = steady_swa_per_request(spec.window, s.swa_eviction_interval, s.page_size)
    return full, min(steady, ceil_page(context, s.page_size) + s.page_size)


def admitted(plan: PoolPlan, spec: ModelSpec, context: int, s: MemorySettings) -> int:
    full, swa = per_request(spec, context, s)
    if not plan.hybrid:  # one pool: every layer keeps the whole context
        return plan.full_tokens // full
    limits = [plan.swa_tokens // swa]
    if plan.full_tokens:  # all-SWA models have no full pool
        limits.append(plan.full_tokens // full)
    return min(limits)


def _point(spec: ModelSpec, budget: int, ratio: float | None, s: MemorySettings) -> PoolPoint:
    try:
        plan = plan_pools(
            spec, page_size=s.page_size, dtype_bytes=s.dtype_bytes, kv_cache_bytes=budget,
            swa_full_tokens_ratio=ratio or 1.0, disable_hybrid_swa_memory=ratio is None,
        )  # fmt: skip
    except ConfigError as exc:
        return PoolPoint(ratio, 0, 0, 0, {c: 0 for c in s.contexts}, error=str(exc))
    counts = {c: admitted(plan, spec, c, s) for c in s.contexts}
    return PoolPoint(ratio, plan.full_tokens, plan.swa_tokens, plan.total_bytes, counts)


def _shared(spec: ModelSpec, budget: int, s: MemorySettings) -> dict[int, int]:
    f = spec.kind_bytes_per_token(LayerKind.FULL, s.dtype_bytes)
    sw = spec.kind_bytes_per_token(LayerKind.SWA, s.dtype_bytes)
    out = {}
    for c in s.contexts:
        full, swa = per_request(spec, c, s)
        out[c] = budget // (full * f + swa * sw)
    return out


def evaluate_model(name: str, spec: ModelSpec, s: MemorySettings) -> ModelResult:
    budgets = []
    for gib in s.budgets_gib:
        budget = int(gib * GIB)
        dual = tuple(_point(spec, budget, r, s) for r in s.ratios)
        budgets.append(
            BudgetResult(gib, _point(spec, budget, None, s), dual, _shared(spec, budget, s))
        )
    return ModelResult(
        name=name,
        architecture=spec.architecture,
        full_layers=len(spec.full_layer_ids),
        swa_layers=len(spec.swa_layer_ids),
        window=spec.window,
        full_bytes_per_token=spec.kind_bytes_per_token(LayerKind.FULL, s.dtype_bytes),
        swa_bytes_per_token=spec.kind_bytes_per_token(LayerKind.SWA, s.dtype_bytes),
        budgets=tuple(budgets),
    )


def best_dual(result: BudgetResult, context: int) -> PoolPoint:
    """The ratio that admits the most requests of `context` tokens (ties: the larger ratio)."""
    return max(result.dual, key=lambda p: (p.admitted[context], p.ratio or 0.0))

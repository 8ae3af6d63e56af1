"""How big one rank's KV pools are: its budget, `plan_pools` over it, the allocator's sizes.

The plan needs the spec (this rank's heads), the dtype and a budget, not the weights. A budget
the config fixes (`kv_cache_bytes`, or `max_total_tokens` as a token count) or a CPU worker's
default is the same on every rank and is planned before the weights load, so a config whose pools
cannot fit fails before any weight is read. On CUDA with neither set, the budget is a share of
what the device has free once the weights are in: planned after the load, with the smallest such
budget of any rank, so that every rank's pools hold the same token counts (docs/design.md §17.1).
"""

from __future__ import annotations

import torch

from worker.config import EngineConfig
from worker.kv.memory_plan import PoolPlan, kv_share_of, plan_pools
from worker.models.spec import ModelSpec
from worker.parallel.group import TPGroup

DEFAULT_CPU_KV_BYTES = 256 << 20  # a CPU worker's KV budget unless the config says otherwise
GPU_KV_FRACTION = 0.85  # of the memory free after the weights are loaded
ALL_SWA_VIRTUAL_FULL = 4  # all-SWA: full slots are addresses without buffers (see below)


def plan_before_load(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> PoolPlan | None:
    """One rank's plan where the budget does not wait on the weights; None where it does."""
    budget = config.kv_cache_bytes
    if budget is None and config.max_total_tokens is None:
        if device.type == "cuda":
            return None
        budget = DEFAULT_CPU_KV_BYTES
    return _plan(config, spec, dtype, budget)


def plan_after_load(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, group: TPGroup
) -> PoolPlan:
    """One rank's plan from `GPU_KV_FRACTION` of what its device has free now (weights loaded),
    the smallest of any rank (a collective: every rank of `group` calls it); the pools share it
    with the prompt-logprob workspace (`kv_share_of`)."""
    free, _ = torch.cuda.mem_get_info(group.device)
    budget = group.min_over_ranks(int(free * GPU_KV_FRACTION))
    return _plan(config, spec, dtype, kv_share_of(budget))


def _plan(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, budget: int | None
) -> PoolPlan:
    return plan_pools(
        spec,
        page_size=config.page_size,
        dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
        swa_full_tokens_ratio=config.swa_full_tokens_ratio,
        kv_cache_bytes=budget if config.max_total_tokens is None else None,
        max_total_tokens=config.max_total_tokens,
        disable_hybrid_swa_memory=config.disable_hybrid_swa_memory,
    )


def allocator_sizes(plan: PoolPlan) -> tuple[int, int]:
    """(full, SWA) token slots of the allocator and pools for `plan`."""
    if plan.full_tokens > 0:
        return plan.full_tokens, plan.swa_tokens
    # NOTE: all-SWA model: no layer lives in the full pool, so full slots are plain addresses
    # with no buffer behind them. Giving the allocator several times the SWA pool in them lets
    # the same tree keep tombstoned prefixes (free) and apply the window rule unchanged.
    return plan.swa_tokens * ALL_SWA_VIRTUAL_FULL, plan.swa_tokens

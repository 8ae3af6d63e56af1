"""The host tier of one engine (docs/design.md §9.9): its size, its pools and copier, and the
per-token costs the scheduler prices load / repair / recompute with.

`host_kv_bytes` unset means: on CUDA, `HOST_KV_MULTIPLE` x the device KV budget, at most
`HOST_RAM_SHARE` of the node's available memory divided by its visible GPUs (every GPU's worker
takes its share); on CPU, 0 (the device pools already are host memory). The tier needs separate
full and SWA pools (a sliding-window model, hybrid pools) and runs on one rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from core.reuse import TierCosts
from worker.cache.host_tier import HostTier
from worker.config import EngineConfig
from worker.kv.host_pool import HostAllocator, HostKVPool
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import HostPlan, PoolPlan, plan_host_pools
from worker.kv.pool import HybridKVPool
from worker.kv.transfer import KVCopier, LocalCopier, TransferQueue
from worker.models.quant.resident import Fp8Linear, Mxfp4Experts
from worker.models.spec import LayerKind, ModelSpec

HOST_KV_MULTIPLE = 4  # the default host tier: 4x the device KV budget ...
HOST_RAM_SHARE = 0.5  # ... at most half the node's available memory over its GPUs


@dataclass(frozen=True)
class HostParts:
    """What an engine keeps of its host tier: the cache's component (allocator, queue,
    counters), the copier that moves the KV, the plan (bytes per token) and the costs."""

    tier: HostTier
    copier: KVCopier
    plan: HostPlan
    costs: TierCosts

    def bytes_per_token(self, kind: LayerKind) -> float:
        p = self.plan
        tokens, nbytes = (p.full_tokens, p.full_bytes) if kind is LayerKind.FULL else (p.swa_tokens, p.swa_bytes)
        return nbytes / tokens if tokens else 0.0


def host_kv_bytes(config: EngineConfig, plan: PoolPlan, device: torch.device) -> int:
    """The host tier's budget: the config's, else the default rule (module docstring)."""
    if config.host_kv_bytes is not None:
        return config.host_kv_bytes
    if device.type != "cuda" or not plan.hybrid or config.tensor_parallel_size > 1:
        return 0
    ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    share = int(ram * HOST_RAM_SHARE) // max(1, torch.cuda.device_count())
    return min(HOST_KV_MULTIPLE * plan.total_bytes, share)


def build_host(
    config: EngineConfig, spec: ModelSpec, plan: PoolPlan, pool: HybridKVPool,
    allocator: HybridAllocator, model: torch.nn.Module,
) -> HostParts | None:  # fmt: skip
    """The host tier over `pool` (None: `host_kv_bytes` resolves to 0)."""
    budget = host_kv_bytes(config, plan, pool.device)
    if budget == 0:
        return None
    dtype_bytes = pool.dtype.itemsize
    ratio = config.host_swa_full_tokens_ratio
    host_plan = plan_host_pools(spec, plan, dtype_bytes=dtype_bytes, host_kv_bytes=budget, ratio=ratio)
    layers = {kind: pool.layers_in_pool(kind) for kind in LayerKind}
    host_pool = HostKVPool(spec, host_plan, layers, pool.dtype, pin=pool.device.type == "cuda")
    tier = HostTier(HostAllocator.from_plan(host_plan), TransferQueue(allocator))
    costs = tier_costs(config, spec, dtype_bytes, active_parameters(model))
    return HostParts(tier, LocalCopier(pool, host_pool), host_plan, costs)


def tier_costs(config: EngineConfig, spec: ModelSpec, dtype_bytes: int, active: int) -> TierCosts:
    """Seconds per token: a prefill (2 x active parameters at `prefill_tflops`), and loading
    one token's KV of every full / SWA layer over the host link (`host_link_gbps`, GB/s)."""
    link = config.host_link_gbps * 1e9
    return TierCosts(
        prefill=2 * active / (config.prefill_tflops * 1e12),
        load_full=spec.kind_bytes_per_token(LayerKind.FULL, dtype_bytes) / link,
        load_swa=spec.kind_bytes_per_token(LayerKind.SWA, dtype_bytes) / link,
    )


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token's forward multiplies with: a mixture of experts' expert weights
    count top_k / experts of themselves (its router says both)."""
    scaled: set[int] = set()
    active = 0
    # Weights kept quantized are buffers of their modules: counted by `weight_numel`.
    kept = [m for m in model.modules() if isinstance(m, (Mxfp4Experts, Fp8Linear))]
    for module in model.modules():
        experts, router = getattr(module, "experts", None), _router(module)
        if isinstance(experts, torch.nn.Module) and router is not None:
            weight: torch.Tensor = getattr(router, "weight")  # noqa: B009 - typed here
            top_k, n = int(getattr(router, "top_k")), int(weight.shape[0])  # noqa: B009
            params = list(experts.parameters())
            inside = [m for m in experts.modules() if isinstance(m, (Mxfp4Experts, Fp8Linear))]
            active += (sum(p.numel() for p in params) + sum(m.weight_numel() for m in inside)) * top_k // n
            scaled.update(id(t) for t in (*params, *inside))
    dense = sum(m.weight_numel() for m in kept if id(m) not in scaled)
    return active + dense + sum(p.numel() for p in model.parameters() if id(p) not in scaled)


def _router(module: torch.nn.Module) -> torch.nn.Module | None:
    for name in ("router", "gate"):
        r = getattr(module, name, None)
        if isinstance(r, torch.nn.Module) and hasattr(r, "top_k") and hasattr(r, "weight"):
            return r
    return None

"""A simulated model runner and the real engine around it, for `swaserve bench routing`.

`SimRunner` has `ModelRunner`'s interface (`forward(ForwardBatch)`, `sample(...)`) but computes
nothing: every request samples token `token_id` (requests run with `ignore_eos`, so they stop at
`max_tokens`). Everything else is the real engine: scheduler, radix cache with tombstones, hybrid
allocator, cache events. Time is virtual: `StepCost` prices one step from the tokens it fed.

`StepCost` defaults (documented in `bench/routing/report.py`'s output too): a step costs

    overhead_s + prefill_token_s x (tokens of prefill chunks) + decode_token_s x (decoding requests)
               + (bytes of KV the step loaded from the host tier) / link_gbps

= 4 ms + 60 us/prefill token (~16k prefill tokens/s) + 0.15 ms per decode row, the shape of a
mid-size model on one accelerator (a batch of 32 decodes: ~9 ms; a 2k-token prefill: ~125 ms),
and loads at 50 GB/s (`host_link_gbps`'s default, PCIe Gen5 x16: GPT-OSS-120B's 36 KiB of full KV
per token in 0.74 us). Offloads are free: they run on a copy stream beside the forward
(docs/design.md §9.9). Only ratios matter for the comparison between policies; the absolute scale
sets TTFT in seconds.

With `host_kv_bytes` > 0 the engine gets a host tier (`sim_host`): its real allocator, transfer
queue and tree states, a copier that moves nothing (there is no KV), and `TierCosts` from this
`StepCost` (a prefill token at `prefill_token_s`, a load at its bytes over the link), so the
scheduler and the router choose load / repair / recompute with the prices the clock charges.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.geometry import Geometry
from core.reuse import TierCosts
from worker.assembly.host import HostParts
from worker.assembly.parts import EngineParts
from worker.cache import create_cache
from worker.cache.host_tier import HostTier
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.kv.host_pool import HostAllocator
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import PoolPlan, plan_host_pools, plan_pools
from worker.kv.transfer import CopyBatch, TransferQueue
from worker.models.spec import KindShape, LayerKind, ModelSpec
from worker.runner.sampler import SampleRow
from worker.runner.standin import ComputeFreeRunner

SIM_VOCAB = 32_000
SIM_MAX_MODEL_LEN = 65_536
SIM_TOKEN = 1  # what every simulated request generates
SIM_DTYPE_BYTES = 2  # bf16 KV: what the pools and the host tier are sized with


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds of one engine step (see the module docstring)."""

    overhead_s: float = 0.004
    prefill_token_s: float = 60e-6
    decode_token_s: float = 150e-6
    link_gbps: float = 50.0  # host -> device, GB/s (EngineConfig.host_link_gbps's default)

    def seconds(self, prefill_tokens: int, decode_tokens: int, loaded_bytes: int = 0) -> float:
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_token_s * decode_tokens
            + loaded_bytes / (self.link_gbps * 1e9)
        )

    def tier_costs(self, spec: ModelSpec, dtype_bytes: int) -> TierCosts:
        """Per-token prices of a prefill and of a load of each kind, as `seconds` charges them."""
        link = self.link_gbps * 1e9
        return TierCosts(
            prefill=self.prefill_token_s,
            load_full=spec.kind_bytes_per_token(LayerKind.FULL, dtype_bytes) / link,
            load_swa=spec.kind_bytes_per_token(LayerKind.SWA, dtype_bytes) / link,
        )


class SimRunner(ComputeFreeRunner):
    """`ComputeFreeRunner` (worker/runner/standin.py: `forward` counts the step's prefill and
    decode tokens, which `StepCost` prices); every row samples `token_id`."""

    def __init__(self, token_id: int = SIM_TOKEN) -> None:
        super().__init__()
        self.token_id = token_id

    def pick(self, row: SampleRow) -> int:
        return self.token_id


def sim_spec(window: int, vocab_size: int = SIM_VOCAB) -> ModelSpec:
    """A hybrid model shape (1 full : 3 SWA layers); only `window` and the kinds matter here."""
    shape = KindShape(num_q_heads=8, num_kv_heads=2, head_dim=64, v_head_dim=64)
    kinds = (LayerKind.FULL, LayerKind.SWA, LayerKind.SWA, LayerKind.SWA) * 2
    return ModelSpec(
        architecture="sim",
        layer_kinds=kinds,
        window=window,
        full=shape,
        swa=shape,
        vocab_size=vocab_size,
        hidden_size=512,
        max_position_embeddings=SIM_MAX_MODEL_LEN,
    )


class SimCopier:
    """The host tier's copier with no KV to move: the tree, the allocators and the transfer
    queue did the bookkeeping; the clock charges the loads (`StepCost.seconds`)."""

    def issue(self, batch: CopyBatch) -> None:
        pass


def sim_host(config: EngineConfig, spec: ModelSpec, plan: PoolPlan, allocator: HybridAllocator,
             cost: StepCost) -> HostParts | None:  # fmt: skip
    """The host tier of `config.host_kv_bytes` (None when 0 or unset), split between kinds as a
    worker splits it (`plan_host_pools`), priced by `cost`."""
    if not config.host_kv_bytes:
        return None
    host_plan = plan_host_pools(spec, plan, dtype_bytes=SIM_DTYPE_BYTES,
                                host_kv_bytes=config.host_kv_bytes,
                                ratio=config.host_swa_full_tokens_ratio)  # fmt: skip
    tier = HostTier(HostAllocator.from_plan(host_plan), TransferQueue(allocator))
    return HostParts(tier, SimCopier(), host_plan, cost.tier_costs(spec, SIM_DTYPE_BYTES))


def build_sim_engine(
    config: EngineConfig, window: int, spec: ModelSpec | None = None, cost: StepCost | None = None
) -> tuple[Engine, SimRunner]:
    """The real `Engine` over pools sized as `build_engine_parts` would, with a `SimRunner`.

    `config.max_total_tokens` sizes the full pool; `swa_full_tokens_ratio` and
    `disable_hybrid_swa_memory` the SWA pool, through the same `plan_pools` as a real worker
    (so its fail-fast checks apply); `host_kv_bytes` the host tier (`sim_host`, priced by
    `cost`). Raises `worker.errors.ConfigError` on an impossible plan.
    `spec` (a real model's layer plan, e.g. a `bench.routing.stacks` preset) replaces the
    default 1 full : 3 SWA shape with `window`.
    """
    spec = spec or sim_spec(window)
    plan = plan_pools(
        spec,
        page_size=config.page_size,
        dtype_bytes=SIM_DTYPE_BYTES,
        swa_full_tokens_ratio=config.swa_full_tokens_ratio,
        max_total_tokens=config.max_total_tokens,
        disable_hybrid_swa_memory=config.disable_hybrid_swa_memory,
    )
    allocator = HybridAllocator(plan.full_tokens, plan.swa_tokens, config.page_size, plan.hybrid)
    host = sim_host(config, spec, plan, allocator, cost or StepCost())
    cache_window = spec.window if plan.hybrid else None
    cache = create_cache(
        allocator,
        Geometry(config.page_size, cache_window, len(spec.swa_layer_ids)),
        enable_radix_cache=config.enable_radix_cache,
        eager_swa_free=config.eager_swa_free,
        swa_eviction_policy=config.swa_eviction_policy,
        tier=None if host is None else host.tier,
    )
    runner = SimRunner()
    parts = EngineParts(spec, allocator, cache, runner, SIM_MAX_MODEL_LEN, plan=plan, host=host)
    return Engine(config, parts), runner

"""A simulated model runner and the real engine around it, for `swaserve bench routing`.

`SimRunner` has `ModelRunner`'s interface (`forward(ForwardBatch)`, `sample(...)`) but computes
nothing: every request samples token `token_id` (requests run with `ignore_eos`, so they stop at
`max_tokens`). Everything else is the real engine: scheduler, radix cache with tombstones, hybrid
allocator, cache events. Time is virtual: `StepCost` prices one step from the tokens it fed.

`StepCost` defaults (documented in `bench/routing/report.py`'s output too): a step costs

    overhead_s + prefill_token_s x (tokens of prefill chunks) + decode_token_s x (decoding requests)

= 4 ms + 60 us/prefill token (~16k prefill tokens/s) + 0.15 ms per decode row, the shape of a
mid-size model on one accelerator (a batch of 32 decodes: ~9 ms; a 2k-token prefill: ~125 ms).
Only ratios matter for the comparison between policies; the absolute scale sets TTFT in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.assembly.parts import EngineParts
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.models.spec import KindShape, LayerKind, ModelSpec
from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.sampler import SampleOutput, SampleRow

SIM_VOCAB = 32_000
SIM_MAX_MODEL_LEN = 65_536
SIM_TOKEN = 1  # what every simulated request generates


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds of one engine step (see the module docstring)."""

    overhead_s: float = 0.004
    prefill_token_s: float = 60e-6
    decode_token_s: float = 150e-6

    def seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_token_s * decode_tokens
        )


class SimRunner:
    """`forward` counts the step's tokens; `sample` returns `token_id` for every row.

    A row feeding one token after a non-empty prefix counts as a decode (a one-token prefill
    rest after a cache hit is priced the same way: one token either way).
    """

    def __init__(self, token_id: int = SIM_TOKEN) -> None:
        self.token_id = token_id
        self.last_prefill_tokens = 0
        self.last_decode_tokens = 0
        self.fed_tokens = 0  # every token fed since start (prefill and decode)
        self.repair_tokens = 0  # of those, repair rows (docs/design.md §9.8; priced as prefill)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        prefill = decode = 0
        for r in batch.reqs:
            n = len(r.token_ids)
            if n == 1 and r.prefix_len > 0 and r.repair is None:
                decode += 1
            else:
                prefill += n
            self.repair_tokens += r.repair_tokens
        self.last_prefill_tokens, self.last_decode_tokens = prefill, decode
        self.fed_tokens += prefill + decode
        # Logits with no vocabulary: the row count is all `sample` needs.
        return ForwardOutput(torch.empty(batch.num_logits, 0))

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        n = len(rows)
        assert n == logits.shape[0], f"{n} sampling rows for {logits.shape[0]} logits rows"
        return SampleOutput([self.token_id] * n, [None] * n, [None] * n)


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


def build_sim_engine(
    config: EngineConfig, window: int, spec: ModelSpec | None = None
) -> tuple[Engine, SimRunner]:
    """The real `Engine` over pools sized as `build_engine_parts` would, with a `SimRunner`.

    `config.max_total_tokens` sizes the full pool; `swa_full_tokens_ratio` and
    `disable_hybrid_swa_memory` the SWA pool, through the same `plan_pools` as a real worker
    (so its fail-fast checks apply). Raises `worker.errors.ConfigError` on an impossible plan.
    `spec` (a real model's layer plan, e.g. a `bench.routing.stacks` preset) replaces the
    default 1 full : 3 SWA shape with `window`.
    """
    from core.geometry import Geometry
    from worker.cache import create_cache
    from worker.kv.hybrid_allocator import HybridAllocator
    from worker.kv.memory_plan import plan_pools

    spec = spec or sim_spec(window)
    plan = plan_pools(
        spec,
        page_size=config.page_size,
        dtype_bytes=2,
        swa_full_tokens_ratio=config.swa_full_tokens_ratio,
        max_total_tokens=config.max_total_tokens,
        disable_hybrid_swa_memory=config.disable_hybrid_swa_memory,
    )
    allocator = HybridAllocator(plan.full_tokens, plan.swa_tokens, config.page_size, plan.hybrid)
    cache_window = spec.window if plan.hybrid else None
    cache = create_cache(
        allocator,
        Geometry(config.page_size, cache_window, len(spec.swa_layer_ids)),
        enable_radix_cache=config.enable_radix_cache,
        eager_swa_free=config.eager_swa_free,
        swa_eviction_policy=config.swa_eviction_policy,
    )
    runner = SimRunner()
    parts = EngineParts(spec, allocator, cache, runner, SIM_MAX_MODEL_LEN, plan=plan)
    return Engine(config, parts), runner

"""A tensor-parallel engine's parts (docs/design.md §17): rank 0's, which the engine uses, and the
other ranks' (`run_rank`), built by the same steps so that every rank's pools agree.

    rank 0 (engine process)                         rank r = 1..N-1 (`run_rank`)
    spec; check the split (ConfigError: nothing started)
    open the store; launcher.start(ranks) ───────▶   connect to the store
    load shard 0                                    load shard r
    join: wait for every "loaded/r" (or a failed   join
          rank: raise), then the process groups
    budget = min over ranks; plan; pools            the same plan; pools
    allocator, cache; TPRunner                      serve_rank: execute each step until Stop
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.geometry import Geometry
from worker.cache import create_cache
from worker.config import EngineConfig
from worker.engine.protocols import RankLauncher, Ranks
from worker.engine.setup import (
    EngineParts,
    allocator_sizes,
    eos_token_ids,
    kv_budget,
    max_model_len,
    plan_for,
    torch_dtype,
)
from worker.errors import ConfigError
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import PoolPlan
from worker.models.causal_lm import CausalLM
from worker.models.compiled import CompilePlan, prepare_model
from worker.models.model_dir import load_tokenizer, resolve_model_dir
from worker.models.spec import ModelSpec
from worker.parallel.group import (
    TPAddress,
    TPGroup,
    connect_store,
    open_store,
    rank_device,
    use_loopback,
)
from worker.parallel.runner import TPRunner, serve_rank
from worker.parallel.shard import shard_spec
from worker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0  # ranks get this long to exit after the stop message


@dataclass
class TensorParallel:
    """What the engine needs of its other ranks: are they alive, do their pools agree, stop."""

    runner: TPRunner
    ranks: Ranks

    def failure(self) -> str | None:
        return self.ranks.failure()

    def check_pools(self) -> None:
        self.runner.check_pools()

    def close(self, force: bool = False) -> None:
        stopped = not force and self.runner.stop()
        self.ranks.stop(STOP_TIMEOUT_S if stopped else 0.0)
        if not force:
            self.runner.close()


@dataclass(frozen=True)
class _Shard:
    spec: ModelSpec  # this rank's heads
    model: CausalLM
    plan: PoolPlan
    dtype: torch.dtype
    device: torch.device


def check_tp_config(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ConfigError before any rank starts when the model cannot be split this way."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if torch.device(config.device).index is not None and size > 1:
        raise ConfigError(
            f"device={config.device!r} names one GPU; with tensor_parallel_size={size} set "
            "device: cuda (rank r uses the r-th GPU it sees)"
        )
    shard_spec(spec, size)


def _load_shard(
    config: EngineConfig,
    model_dir: Path,
    spec: ModelSpec,
    group: TPGroup,
    store: torch.distributed.Store,
    peers_failure: Callable[[], str | None],
) -> _Shard:
    from worker.models.loader import load_model

    dtype, device = torch_dtype(config.dtype), group.device
    model = load_model(model_dir, spec, dtype=dtype, device=device, group=group)
    # NOTE: each rank packs its own shard; torch.compile stays off under tensor parallelism
    # (the all-reduces inside the layers are not traced; docs/design.md §19).
    compile_plan = dataclasses.replace(CompilePlan.for_mode(config.compile, device), backend=None)
    logger.info("rank %d model: %s", group.rank, prepare_model(model, compile_plan, device, dtype))
    group.join(store, peers_failure)
    rank_spec = shard_spec(spec, group.size)
    budget = kv_budget(config, device)  # NOTE: after the weights: what is free on this device
    if budget is not None:
        budget = group.min_over_ranks(budget)  # every rank plans the same token counts
    return _Shard(rank_spec, model, plan_for(config, rank_spec, dtype, budget), dtype, device)


def _runner(config: EngineConfig, shard: _Shard, allocator: HybridAllocator | None) -> ModelRunner:
    from worker.attention import create_backend
    from worker.kv.pool import HybridKVPool

    full_size, swa_size = allocator_sizes(shard.plan, shard.spec)
    pool = HybridKVPool(
        shard.spec, full_size, swa_size, config.page_size, shard.dtype, shard.device,
        hybrid=shard.plan.hybrid,
    )  # fmt: skip
    backend = create_backend(config.attention_backend, pool, shard.spec, shard.device)
    return ModelRunner(
        shard.spec, shard.model, pool, allocator, backend, device=shard.device,
        table_rows=config.max_running_requests,
        table_width=max_model_len(config, shard.spec) + config.page_size,
    )  # fmt: skip


def build_tp_engine_parts(config: EngineConfig, launcher: RankLauncher | None) -> EngineParts:
    """Rank 0's parts; the other ranks run `run_rank` (started by `launcher`)."""
    from worker.engine.rank_processes import ProcessLauncher
    from worker.models.hf_config import load_spec

    model_dir = resolve_model_dir(config.model)
    spec = load_spec(model_dir)
    check_tp_config(config, spec)
    launcher = launcher or ProcessLauncher()
    store, address = open_store(launcher.rendezvous_host())
    use_loopback(address)
    # The ranks read the directory rank 0 resolved ("tiny" is built once, here).
    ranks = launcher.start(dataclasses.replace(config, model=str(model_dir)), address)
    group = TPGroup(0, config.tensor_parallel_size, rank_device(config.device, 0))
    try:
        shard = _load_shard(config, model_dir, spec, group, store, ranks.failure)
        logger.info("KV pools of each of %d ranks: %s", group.size, shard.plan.describe())
        full_size, swa_size = allocator_sizes(shard.plan, shard.spec)
        allocator = HybridAllocator(full_size, swa_size, config.page_size, hybrid=shard.plan.hybrid)
        runner = TPRunner(_runner(config, shard, allocator), group, spec.vocab_size, spec)
    except BaseException:
        ranks.stop(0.0)
        group.close()
        raise
    window = spec.window if shard.plan.hybrid else None
    cache = create_cache(
        allocator,
        Geometry(config.page_size, window, len(spec.swa_layer_ids)),
        enable_radix_cache=config.enable_radix_cache,
        eager_swa_free=config.eager_swa_free,
        swa_eviction_policy=config.swa_eviction_policy,
    )
    return EngineParts(
        spec=spec,
        allocator=allocator,
        cache=cache,
        runner=runner,
        max_model_len=max_model_len(config, spec),
        eos_token_ids=eos_token_ids(model_dir),
        tokenizer_loader=lambda: load_tokenizer(model_dir),
        model_dir=model_dir,
        plan=shard.plan,
        tp=TensorParallel(runner, ranks),
    )


def run_rank(config: EngineConfig, rank: int, address: TPAddress, threads: int | None) -> None:
    """Rank `rank` (>= 1) of a tensor-parallel engine: load its shard, then execute every step
    rank 0 broadcasts until told to stop. Raises when a collective fails (rank 0 gone)."""
    from worker.models.hf_config import load_spec

    if threads is not None:
        torch.set_num_threads(threads)
    use_loopback(address)
    store = connect_store(address)
    model_dir = Path(config.model)
    spec = load_spec(model_dir)
    group = TPGroup(rank, config.tensor_parallel_size, rank_device(config.device, rank))
    try:
        shard = _load_shard(config, model_dir, spec, group, store, lambda: None)
        serve_rank(_runner(config, shard, None), group, spec.vocab_size)
    finally:
        group.close()

"""One rank's share of an engine, built by the same steps on every rank; a single device is rank 0
of 1 (docs/design.md §17). Rank 0 builds through `build_engine_parts` (`builder.py`), which adds
the cache and the other ranks; ranks 1..N-1 run `run_rank`.

    rank 0 (`build_engine_parts`)                     rank r = 1..N-1 (`run_rank`)
    spec; check the split (ConfigError: nothing started)
    N > 1: open the store; launcher.start(ranks) ──▶  connect to the store
    build_rank:                                       build_rank:
      plan the pools when the budget is fixed           the same plan
      load shard 0, pack (compile: one rank only)       load shard r, pack
      join: wait for every "loaded/r" (or a failed      join
        rank: raise), then the process groups
      CUDA default budget: plan now, the smallest       the same plan
        free memory of any rank
      allocator (rank 0 only), pools, backend, runner   pools, backend, runner
    the cache; a `TPRunner` around the runner         serve_rank: execute each step until Stop
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.assembly.pools import allocator_sizes, plan_after_load, plan_before_load
from worker.attention import create_backend
from worker.attention.flashinfer_backend import FA2_MAX_QUERY_ROWS
from worker.config import EngineConfig
from worker.errors import ConfigError
from worker.heap import freeze_heap
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import PoolPlan, plan_logprob_rows
from worker.kv.pool import HybridKVPool
from worker.models.causal_lm import CausalLM
from worker.models.compiled import CompilePlan, prepare_model, uncompile
from worker.models.hf_config import load_spec
from worker.models.loader import load_model
from worker.models.quant.resident import stored_bytes
from worker.models.spec import ModelSpec
from worker.parallel.group import TPAddress, TPGroup, connect_store, rank_device, use_loopback
from worker.parallel.runner import serve_rank
from worker.parallel.shard import shard_spec
from worker.runner.cuda_graphs import DecodeGraphs, capturable, graph_batch_sizes
from worker.runner.model_runner import WARM_UP_SIZES, ModelRunner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RankParts:
    """What one rank built: its spec (its share of the heads), its pools' plan and its runner
    (rank 0's holds the allocator; the other ranks have none)."""

    spec: ModelSpec
    plan: PoolPlan
    runner: ModelRunner


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    return min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def build_rank(config: EngineConfig, model_dir: Path, spec: ModelSpec, group: TPGroup) -> RankParts:
    """Rank `group.rank`'s shard of the model, its pools, backend and runner (pools.py says when
    the plan is made). `spec` is the whole model's."""
    select_device(group.device)
    dtype = torch_dtype(config.dtype)
    rank_spec = shard_spec(spec, group.size)
    plan = plan_before_load(config, rank_spec, dtype, group.device)
    model = _load(config, model_dir, spec, group, dtype)
    group.join()  # NOTE: after the load, so a slow load never counts against a collective
    plan = plan or plan_after_load(config, rank_spec, dtype, group)
    if group.is_first:
        ranks = f" of each of {group.size} ranks" if group.size > 1 else ""
        logger.info("KV pools%s: %s", ranks, plan.describe())
    width = max_model_len(config, spec) + config.page_size  # page-table positions per row
    runner = _runner(config, rank_spec, plan, model, group, width)
    sizes = warm_up_sizes(model, group.device)
    if sizes is not None:
        _warm_up(runner, sizes)
    if group.size == 1:  # NOTE: tensor-parallel ranks run eagerly (docs/design.md §18.2)
        runner.graphs = decode_graphs(config, runner, width)
    return RankParts(rank_spec, plan, runner)


def select_device(device: torch.device) -> None:
    """Make a CUDA `device` this thread's current one, before anything is allocated.

    NOTE: tensors carry their device, but CUDA graphs, events and the current stream belong to
    the current device: with `device: cuda:1` and no `set_device`, a capture recorded on
    device 0 while the kernels ran on 1. The step threads pin it again where they replay
    (`DecodeGraphs`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _runner(
    config: EngineConfig, spec: ModelSpec, plan: PoolPlan, model: CausalLM, group: TPGroup,
    width: int,
) -> ModelRunner:  # fmt: skip
    """The rank's pools, backend and runner; the allocator on rank 0 only (it hands out every
    rank's slots: the plans agree on the token counts)."""
    full_size, swa_size = allocator_sizes(plan)
    allocator = None
    if group.is_first:
        allocator = HybridAllocator(full_size, swa_size, config.page_size, hybrid=plan.hybrid)
    dtype = torch_dtype(config.dtype)
    pool = HybridKVPool(
        spec, full_size, swa_size, config.page_size, dtype, group.device, hybrid=plan.hybrid
    )
    backend = create_backend(config.attention_backend, pool, spec, group.device)
    logprobs = plan_logprob_rows(plan.total_bytes, spec.vocab_size)
    if group.is_first:
        logger.info("prompt logprobs: %d rows at a time (%d bytes)", logprobs.rows, logprobs.bytes)
    return ModelRunner(
        spec, model, pool, allocator, backend, device=group.device,
        table_rows=config.max_running_requests, table_width=width, logprob_rows=logprobs.rows,
    )  # fmt: skip


def _load(
    config: EngineConfig, model_dir: Path, spec: ModelSpec, group: TPGroup, dtype: torch.dtype
) -> CausalLM:
    keep = config.quantized_weights == "keep"
    model = load_model(model_dir, spec, dtype=dtype, device=group.device, group=group, keep_quantized=keep)
    if group.is_first:
        logger.info("model weights: %.2f GB as held (%s)", stored_bytes(model) / 1e9, config.quantized_weights)
    compile_plan = CompilePlan.for_mode(config.compile, group.device)
    if group.size > 1:
        # NOTE: each rank packs its own shard; torch.compile stays off under tensor parallelism
        # (the all-reduces inside the layers are not traced; docs/design.md §19).
        compile_plan = dataclasses.replace(compile_plan, backend=None)
    who = f"rank {group.rank} model" if group.size > 1 else "model"
    logger.info("%s: %s", who, prepare_model(model, compile_plan, group.device, dtype, config.small_step_kernel))
    return model


def warm_up_sizes(model: CausalLM, device: torch.device) -> tuple[int, ...] | None:
    """The token counts of the warm-up forwards, or None for no warm-up.

    A compiled model compiles its variants there. On CUDA, FlashInfer JIT-builds the kernels it
    runs on first use (minutes for a fresh cache): a warm-up on every rank, tensor-parallel
    ones too, builds the decode kernels and, with a query longer than `FA2_MAX_QUERY_ROWS`,
    the long-prefill ones, before the engine serves anything."""
    if device.type == "cuda":
        return (*WARM_UP_SIZES, FA2_MAX_QUERY_ROWS + 1)
    return WARM_UP_SIZES if model.compiled is not None else None


def _warm_up(runner: ModelRunner, sizes: tuple[int, ...]) -> None:
    """Compile and build kernels now (before any graph capture): the runner is ready after it."""
    try:
        runner.warm_up(sizes)
    except Exception as exc:
        if runner.device.type != "cpu":
            raise
        # NOTE: inductor on CPU needs a C++ compiler; without one the packed model still
        # serves, eagerly (docs/design.md §19).
        logger.warning("torch.compile failed on CPU (%s: %s); serving eagerly",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
        uncompile(runner.model)


def decode_graphs(
    config: EngineConfig, runner: ModelRunner, max_seq_len: int
) -> DecodeGraphs | None:
    """The runner's captured decode graphs (docs/design.md §18.2), or None: `cuda_graphs: off`,
    or `auto` where the device, backend or model cannot be captured (logged with why)."""
    if config.cuda_graphs == "off":
        return None
    why = capturable(runner.model, runner.backend, runner.device)
    if why is not None:
        if runner.device.type == "cuda":
            logger.info("CUDA graphs off: %s", why)
        return None
    sizes = graph_batch_sizes(config.cuda_graph_batch_sizes, config.max_running_requests)
    graphs = DecodeGraphs(
        runner.model, runner.pool, runner.backend, runner.spec, runner.device, sizes, max_seq_len
    )
    try:
        graphs.capture()
    except Exception:  # noqa: BLE001 - auto: a forward that cannot be captured runs eagerly
        logger.warning("CUDA graph capture failed; decoding eagerly", exc_info=True)
        torch.cuda.synchronize(runner.device)
        return None
    return graphs


def run_rank(config: EngineConfig, rank: int, address: TPAddress, threads: int | None) -> None:
    """Rank `rank` (>= 1) of a tensor-parallel engine: build its share, then execute every step
    rank 0 broadcasts until told to stop. Raises when a collective fails (rank 0 gone)."""
    if threads is not None:
        torch.set_num_threads(threads)
    use_loopback(address)
    size = config.tensor_parallel_size
    model_dir = Path(config.model)  # the directory rank 0 resolved
    spec = load_spec(model_dir)
    group = TPGroup(rank, size, rank_device(config.device, rank, size), connect_store(address))
    try:
        built = build_rank(config, model_dir, spec, group)
        freeze_heap()  # a full collection would stall every rank's collectives
        serve_rank(built.runner, group, spec.vocab_size)
    finally:
        group.close()

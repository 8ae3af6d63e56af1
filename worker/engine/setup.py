"""Build an engine's parts from an `EngineConfig`: spec, pool plan, allocator, pools, cache,
model, attention backend, runner. Kept apart from `Engine` so tests can inject fakes
(`EngineParts` is what the engine needs; build it by hand with a fake runner)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.geometry import Geometry
from worker.cache import create_cache
from worker.cache.base import PrefixCache
from worker.config import CUDA_GRAPH_MODES, EngineConfig
from worker.engine.protocols import RankLauncher, Runner
from worker.errors import ConfigError
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import PoolPlan, plan_pools
from worker.models.compiled import CompilePlan, prepare_model, uncompile
from worker.models.model_dir import Tokenizer, load_tokenizer, resolve_model_dir
from worker.models.spec import ModelSpec

if TYPE_CHECKING:
    from worker.engine.tp_setup import TensorParallel
    from worker.runner.cuda_graphs import DecodeGraphs
    from worker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 256 << 20  # a CPU worker's KV budget unless the config says otherwise
GPU_KV_FRACTION = 0.85  # of the memory free after the weights are loaded
ALL_SWA_VIRTUAL_FULL = 4  # all-SWA: full slots are addresses without buffers (see below)


@dataclass
class EngineParts:
    spec: ModelSpec
    allocator: HybridAllocator
    cache: PrefixCache
    runner: Runner  # a ModelRunner, or a compute-free stand-in (bench.sim_runner.SimRunner)
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_loader: Callable[[], Tokenizer] | None = None
    model_dir: Path | None = None
    plan: PoolPlan | None = None  # with tensor parallelism: one rank's pools
    tp: TensorParallel | None = None  # the other ranks (tensor_parallel_size > 1)

    @property
    def cache_window(self) -> int | None:
        """The window the cache and scheduler budget with: None without a separate SWA pool."""
        return self.spec.window if self.allocator.hybrid else None


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_engine_parts(config: EngineConfig, launcher: RankLauncher | None = None) -> EngineParts:
    """The parts of one engine; with `tensor_parallel_size > 1` rank 0's, after `launcher`
    (default: local processes) started the other ranks (docs/design.md §17)."""
    if config.tensor_parallel_size > 1:
        from worker.engine.tp_setup import build_tp_engine_parts

        return build_tp_engine_parts(config, launcher)
    from worker.attention import create_backend
    from worker.kv.pool import HybridKVPool
    from worker.models.hf_config import load_spec
    from worker.models.loader import load_model
    from worker.runner.model_runner import ModelRunner

    model_dir = resolve_model_dir(config.model)
    spec = load_spec(model_dir)
    dtype = torch_dtype(config.dtype)
    device = torch.device(config.device)
    model = load_model(model_dir, spec, dtype=dtype, device=device)
    compile_plan = CompilePlan.for_mode(config.compile, device)
    logger.info("model: %s", prepare_model(model, compile_plan, device, dtype))
    plan = _plan(config, spec, dtype, device)
    logger.info("KV pools: %s", plan.describe())
    full_size, swa_size = allocator_sizes(plan, spec)
    hybrid = plan.hybrid
    allocator = HybridAllocator(full_size, swa_size, config.page_size, hybrid=hybrid)
    pool = HybridKVPool(spec, full_size, swa_size, config.page_size, dtype, device, hybrid=hybrid)
    cache = create_cache(
        allocator,
        Geometry(config.page_size, spec.window if hybrid else None, len(spec.swa_layer_ids)),
        enable_radix_cache=config.enable_radix_cache,
        eager_swa_free=config.eager_swa_free,
        swa_eviction_policy=config.swa_eviction_policy,
    )
    if config.attention_backend == "flashinfer" and device.type != "cuda":
        raise ConfigError("attention_backend 'flashinfer' needs a CUDA device; use 'torch' on CPU")
    backend = create_backend(config.attention_backend, pool, spec, device)
    width = max_model_len(config, spec) + config.page_size
    runner = ModelRunner(
        spec, model, pool, allocator, backend, device=device,
        table_rows=config.max_running_requests, table_width=width,
    )  # fmt: skip
    if model.compiled is not None:
        try:
            runner.warm_up()  # compiles now (before any graph capture): ready after it
        except Exception as exc:
            if device.type != "cpu":
                raise
            # NOTE: inductor on CPU needs a C++ compiler; without one the packed model still
            # serves, eagerly (docs/design.md §19).
            logger.warning("torch.compile failed on CPU (%s: %s); serving eagerly",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
            uncompile(model)
    runner.graphs = decode_graphs(config, runner, width)
    return EngineParts(
        spec=spec,
        allocator=allocator,
        cache=cache,
        runner=runner,
        max_model_len=max_model_len(config, spec),
        eos_token_ids=eos_token_ids(model_dir),
        tokenizer_loader=lambda: load_tokenizer(model_dir),
        model_dir=model_dir,
        plan=plan,
    )


def decode_graphs(config: EngineConfig, runner: ModelRunner, max_seq_len: int) -> DecodeGraphs | None:
    """The runner's captured decode graphs (docs/design.md §18.2), or None: `cuda_graphs: off`,
    or `auto` where the device, backend or model cannot be captured (logged with why)."""
    if config.cuda_graphs not in CUDA_GRAPH_MODES:
        raise ConfigError(f"cuda_graphs {config.cuda_graphs!r} is not one of {list(CUDA_GRAPH_MODES)}")
    if config.cuda_graphs == "off":
        return None
    from worker.runner.cuda_graphs import DecodeGraphs, capturable, graph_batch_sizes

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


def max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    return min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def _plan(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> PoolPlan:
    return plan_for(config, spec, dtype, kv_budget(config, device))


def kv_budget(config: EngineConfig, device: torch.device) -> int | None:
    """KV bytes of one device (one rank): the config's, or what is free after the weights."""
    budget = config.kv_cache_bytes
    if budget is None and config.max_total_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    return budget


def plan_for(
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


def allocator_sizes(plan: PoolPlan, spec: ModelSpec) -> tuple[int, int]:
    if plan.full_tokens > 0:
        return plan.full_tokens, plan.swa_tokens
    # NOTE: all-SWA model: no layer lives in the full pool, so full slots are plain addresses
    # with no buffer behind them. Giving the allocator several times the SWA pool in them lets
    # the same tree keep tombstoned prefixes (free) and apply the window rule unchanged.
    return plan.swa_tokens * ALL_SWA_VIRTUAL_FULL, plan.swa_tokens


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list in HF files)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()

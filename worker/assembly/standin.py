"""`build_standin_parts`: the parts of an engine whose model is the benchmarks' compute-free
stand-in (`EngineConfig.standin_tokens_per_s`, docs/design.md §22).

Everything but the model is what `build_engine_parts` builds: the spec from the model's config,
the pools' plan over the same budget, the allocator, the radix cache, the stop tokens and the
tokenizer. No weights are read and no KV buffers allocated (nothing would read them): the plan
and the allocator are the bookkeeping the scheduler and the cache run on. The tokenizer is loaded
here, once: its special ids, with EOS, are what the stand-in never emits (`plain_vocabulary`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from worker.assembly.parts import EngineParts, configured_cache
from worker.assembly.pools import allocator_sizes, plan_before_load
from worker.assembly.rank import max_model_len, torch_dtype
from worker.config import EngineConfig
from worker.errors import ConfigError
from worker.kv.hybrid_allocator import HybridAllocator
from worker.models.model_dir import load_tokenizer
from worker.models.spec import ModelSpec
from worker.runner.standin import StandInRunner, plain_vocabulary

logger = logging.getLogger(__name__)


def build_standin_parts(
    config: EngineConfig, model_dir: Path, spec: ModelSpec, eos: tuple[int, ...]
) -> EngineParts:
    """An engine's parts around a `StandInRunner` at `config.standin_tokens_per_s`."""
    rate = config.standin_tokens_per_s
    assert rate is not None, "only for a config that asks for the stand-in"
    plan = plan_before_load(config, spec, torch_dtype(config.dtype), torch.device("cpu"))
    if plan is None:  # the CPU default budget always plans; kept for the type
        raise ConfigError("standin_tokens_per_s: set kv_cache_bytes or max_total_tokens")
    full, swa = allocator_sizes(plan)
    allocator = HybridAllocator(full, swa, config.page_size, hybrid=plan.hybrid)
    cache = configured_cache(config, spec, allocator)
    tokenizer = load_tokenizer(model_dir)
    special = (*eos, *getattr(tokenizer, "all_special_ids", ()))
    runner = StandInRunner(plain_vocabulary(spec.vocab_size, special), rate)
    logger.info("stand-in model: %g tokens/s per request, %d ids; KV pools (bookkeeping only): %s",
                rate, len(runner.vocab), plan.describe())  # fmt: skip
    return EngineParts(
        spec=spec,
        allocator=allocator,
        cache=cache,
        runner=runner,
        max_model_len=max_model_len(config, spec),
        eos_token_ids=eos,
        tokenizer_loader=lambda: tokenizer,
        model_dir=model_dir,
        plan=plan,
    )

"""`build_engine_parts`: an `EngineParts` from an `EngineConfig`, built as rank 0 of
`tensor_parallel_size` ranks (one device is rank 0 of 1). Rank 0 checks the split before anything
starts, starts the other ranks, builds its share the way every rank does (`rank.py`), then adds
what exists once: the cache over its allocator (with the host tier, docs/design.md §9.9), the
stop tokens, the tokenizer and, with N > 1, a `TPRunner` and the other ranks (docs/design.md
§17). With `standin_tokens_per_s` set the model is the benchmarks' compute-free stand-in
(`standin.py`): no rank, no weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from worker.assembly.host import build_host
from worker.assembly.parts import EngineParts, configured_cache
from worker.assembly.rank import build_rank, max_model_len
from worker.assembly.rank_processes import ProcessLauncher
from worker.assembly.ranks import RankLauncher, Ranks, TensorParallel
from worker.assembly.standin import build_standin_parts
from worker.config import EngineConfig
from worker.models.hf_config import load_spec
from worker.models.model_dir import load_tokenizer, resolve_model_dir
from worker.models.spec import ModelSpec
from worker.parallel.group import TPGroup, open_store, rank_device, use_loopback
from worker.parallel.runner import TPRunner
from worker.parallel.shard import shard_spec
from worker.runner.base import Runner


def build_engine_parts(config: EngineConfig, launcher: RankLauncher | None = None) -> EngineParts:
    """The parts of one engine; with `tensor_parallel_size > 1`, after `launcher` (default: local
    processes) started the other ranks."""
    model_dir = resolve_model_dir(config.model)
    spec = load_spec(model_dir)
    if config.standin_tokens_per_s is not None:  # benchmarks: no model (docs/design.md §22)
        return build_standin_parts(config, model_dir, spec, eos_token_ids(model_dir))
    check_tp_config(config, spec)
    group, ranks = _start(config, model_dir, launcher)
    try:
        built = build_rank(config, model_dir, spec, group)
    except BaseException:
        if ranks is not None:
            ranks.stop(0.0)
        group.close()
        raise
    allocator = built.runner.allocator
    assert allocator is not None, "rank 0 owns the allocator"
    runner: Runner = built.runner
    tp = None
    if ranks is not None:
        tp = TensorParallel(TPRunner(built.runner, group, spec.vocab_size, spec), ranks)
        runner = tp.runner
    host = None
    if ranks is None:  # NOTE: one rank only (the config refuses a tier under tensor parallelism)
        pool, model = built.runner.pool, built.runner.model
        host = build_host(config, built.spec, built.plan, pool, allocator, model)
    cache = configured_cache(config, spec, allocator, None if host is None else host.tier)
    return EngineParts(
        spec=spec,
        allocator=allocator,
        cache=cache,
        runner=runner,
        max_model_len=max_model_len(config, spec),
        eos_token_ids=eos_token_ids(model_dir),
        tokenizer_loader=lambda: load_tokenizer(model_dir),
        model_dir=model_dir,
        plan=built.plan,
        tp=tp,
        host=host,
    )


def _start(
    config: EngineConfig, model_dir: Path, launcher: RankLauncher | None
) -> tuple[TPGroup, Ranks | None]:
    """Rank 0's group; with N > 1 the other ranks too, started (they join rank 0's store)."""
    size = config.tensor_parallel_size
    device = rank_device(config.device, 0, size)
    if size == 1:
        return TPGroup(0, 1, device), None
    launcher = launcher or ProcessLauncher()
    store, address = open_store(launcher.rendezvous_host())
    use_loopback(address)
    # The ranks read the directory rank 0 resolved ("tiny" is built once, here).
    ranks = launcher.start(dataclasses.replace(config, model=str(model_dir)), address)
    return TPGroup(0, size, device, store, ranks.failure), ranks


def check_tp_config(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ConfigError before any rank starts when the model cannot be split this way."""
    shard_spec(spec, config.tensor_parallel_size)  # the config itself checked size and device


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list in HF files)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()

"""`EngineConfig`: the one frozen config the worker receives (docs/design.md §4.1).

The edges (`deploy/`) validate user input with pydantic and convert once into this dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import ConfigError

SWA_EVICTION_POLICIES = ("tail_first", "lru")  # docs/design.md §9.5
OVERLAP_SCHEDULE_MODES = ("auto", "on", "off")  # docs/design.md §11.8
TOMBSTONE_REPAIR_MODES = ("auto", "off")  # docs/design.md §9.8
CUDA_GRAPH_MODES = ("auto", "off")  # docs/design.md §18.2
COMPILE_MODES = ("auto", "off")  # docs/design.md §19


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # built-in name or a local HF directory
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    attention_backend: str = "torch"  # torch | flashinfer
    page_size: int = 16
    kv_cache_bytes: int | None = None  # KV byte budget; None: derived from max_total_tokens or a default
    max_total_tokens: int | None = None  # full-pool tokens; overrides kv_cache_bytes
    swa_full_tokens_ratio: float = 0.8  # SWA pool tokens = ratio x full pool tokens, in (0, 1]
    disable_hybrid_swa_memory: bool = False  # one pool for all layers (SWA layers keep their KV)
    enable_radix_cache: bool = True
    # Tokens one step feeds, decodes included (vLLM's max_num_batched_tokens): decodes first,
    # prefill chunks fill the rest. 1024 on CPU measured best (docs/design.md §11.7).
    max_num_batched_tokens: int = 1024
    chunked_prefill_size: int | None = None  # most prompt tokens per step; None: the budget's rest
    max_running_requests: int = 64
    swa_eviction_interval: int = 128  # decode frees out-of-window SWA once this many tokens left it
    eager_swa_free: bool = False  # free SWA of unfinished prefills at once (docs/design.md §10.1)
    swa_eviction_policy: str = "tail_first"  # tail_first | lru (docs/design.md §9.5)
    tombstone_repair: str = "auto"  # auto | off: rebuild tombstoned SWA from full KV (§9.8)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks splitting the model, one device each (docs/design.md §17)
    cuda_graphs: str = "auto"  # auto | off: decode as captured CUDA graphs where possible (§18.2)
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: the defaults up to max_running
    # on: schedule step N+1 while step N's forward runs, its sampled tokens processed one step
    # late (single-rank runners); off: one step at a time; auto: on for CUDA devices, off on CPU
    # (measured: the host work it hides is a few % of a CPU step; docs/design.md §11.8)
    overlap_schedule: str = "auto"
    compile: str = "auto"  # auto | off: packed CPU linears / torch.compile on GPU (§19)


def repairs_tombstones(config: EngineConfig) -> bool:
    """Whether an engine with this config repairs tombstoned prefixes (docs/design.md §9.8):
    `tombstone_repair: auto` and a radix cache (the chunk cache never matches)."""
    return config.tombstone_repair == "auto" and config.enable_radix_cache


def prefill_budget(config: EngineConfig) -> int:
    """The most prompt tokens one step may prefill (before decodes take their share)."""
    chunk, budget = config.chunked_prefill_size, config.max_num_batched_tokens
    return budget if chunk is None else min(chunk, budget)


def overlaps(config: EngineConfig) -> bool:
    """Whether an engine with this config schedules with overlap (docs/design.md §11.8)."""
    mode = config.overlap_schedule
    return mode == "on" or (mode == "auto" and config.device.startswith("cuda"))


def check_scheduling(config: EngineConfig) -> None:
    """Raise ConfigError for a step budget the scheduler cannot work with."""
    if config.overlap_schedule not in OVERLAP_SCHEDULE_MODES:
        raise ConfigError(
            f"overlap_schedule must be one of {OVERLAP_SCHEDULE_MODES}, got {config.overlap_schedule!r}"
        )
    chunk = config.chunked_prefill_size
    if config.max_num_batched_tokens < 1 or (chunk is not None and chunk < 1):
        raise ConfigError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) and chunked_prefill_size "
            f"({chunk}) must be >= 1"
        )
    if config.max_num_batched_tokens < config.max_running_requests:
        raise ConfigError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below "
            f"max_running_requests ({config.max_running_requests}): every running request "
            "decodes one token per step; raise the budget or lower max_running_requests"
        )

"""`EngineConfig`: the one declaration of every engine knob and the frozen config the worker
receives (docs/design.md §4.1).

Each field declares its type, its default and a `Knob`: the description users read (YAML, Helm
values) and the values it may take. `deploy/config.py` makes its pydantic fields from these
declarations and converts user input once into this dataclass. Construction checks every knob
and the rules between them, so a bad value fails with a `ConfigError` naming the field and what
to change, whether it came from a YAML file or from Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, get_type_hints

from worker.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "flashinfer")
SWA_EVICTION_POLICIES = ("tail_first", "lru")  # docs/design.md §9.5
OVERLAP_SCHEDULE_MODES = ("auto", "on", "off")  # docs/design.md §11.8
TOMBSTONE_REPAIR_MODES = ("auto", "off")  # docs/design.md §9.8
CUDA_GRAPH_MODES = ("auto", "off")  # docs/design.md §18.2
COMPILE_MODES = ("auto", "off")  # docs/design.md §19
SMALL_STEP_KERNEL_MODES = ("auto", "on", "off")  # docs/design.md §19
QUANTIZED_WEIGHTS_MODES = ("dequantize", "keep")  # docs/design.md §16
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


@dataclass(frozen=True)
class Knob:
    """What an `EngineConfig` field declares besides its type and default. The bounds are named
    as pydantic's `Field` names them, so the edge passes them on unchanged (`bounds()`)."""

    description: str
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    min_length: int | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def bounds(self) -> dict[str, Any]:
        """The set constraints besides `choices`, by their pydantic `Field` names."""
        named: dict[str, Any] = {"pattern": self.pattern, "min_length": self.min_length}
        named |= {"ge": self.ge, "gt": self.gt, "le": self.le}
        return {k: v for k, v in named.items() if v is not None}

    def problem(self, name: str, value: Any) -> str | None:
        """Why `value` cannot be field `name`, or None. None values pass: they mean unset."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"{name} {value!r} is not one of {list(self.choices)}"
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return f"{name} {value!r} does not match {self.pattern}"
        if self.min_length is not None and len(value) < self.min_length:
            return f"{name} must have at least {self.min_length} character(s), got {value!r}"
        if self.ge is not None and value < self.ge:
            return f"{name} must be >= {self.ge:g}, got {value}"
        if self.gt is not None and value <= self.gt:
            return f"{name} must be > {self.gt:g}, got {value}"
        if self.le is not None and value > self.le:
            return f"{name} must be <= {self.le:g}, got {value}"
        return None


T = TypeVar("T")
_KNOB = "knob"  # the key of a field's `Knob` in its dataclass metadata


def knob(default: T, description: str, **limits: Any) -> T:
    """An `EngineConfig` field: its default and its `Knob` (`limits`: the `Knob` fields)."""
    return field(default=default, metadata={_KNOB: Knob(description, **limits)})


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of one engine (one replica, all its tensor-parallel ranks); checked on
    construction (`ConfigError`)."""

    model: str = knob(
        "tiny",
        "'tiny' (the built-in test model) or a local Hugging Face model directory.",
        min_length=1,
    )
    dtype: str = knob("float32", "Weights and KV dtype.", choices=DTYPES)
    device: str = knob("cpu", "Engine device: cpu, cuda or cuda:N.", pattern=DEVICE_PATTERN)
    attention_backend: str = knob(
        "torch", "torch (CPU and GPU reference) or flashinfer (GPU only).", choices=ATTENTION_BACKENDS,
    )
    page_size: int = knob(
        16,
        "Tokens per KV page (power of two); the unit of allocation, cache events and routing.",
        ge=1,
    )
    kv_cache_bytes: int | None = knob(
        None,
        "KV byte budget of one worker; unset: derived from max_total_tokens or the engine default.",
        gt=0,
    )
    max_total_tokens: int | None = knob(
        None, "Full-pool tokens of one worker (exclusive with kv_cache_bytes).", gt=0,
    )
    swa_full_tokens_ratio: float = knob(
        0.8, "SWA pool tokens = ratio x full pool tokens, in (0, 1].", gt=0, le=1,
    )
    disable_hybrid_swa_memory: bool = knob(
        False, "One pool for all layers: SWA layers keep all their KV (no SWA freeing).",
    )
    enable_radix_cache: bool = knob(True, "Prefix (radix) cache; off: chunk cache only.")
    # 1024 on CPU measured best (docs/design.md §11.7).
    max_num_batched_tokens: int = knob(
        2048,
        "Tokens one engine step feeds, decodes included (vLLM's knob): every decode first, "
        "prefill chunks fill the rest (>= max_running_requests; GPUs want 8192).",
        ge=1,
    )
    chunked_prefill_size: int | None = knob(
        None,
        "Most prompt tokens prefilled per step; unset: what max_num_batched_tokens leaves after "
        "the decodes.",
        ge=1,
    )
    max_running_requests: int = knob(64, "Most requests decoding together in one worker.", ge=1)
    swa_eviction_interval: int = knob(
        128, "Decode frees out-of-window SWA KV once this many tokens left the window.", ge=1,
    )
    # docs/design.md §10.1
    eager_swa_free: bool = knob(
        False, "Free SWA KV of unfinished chunked prefills at once (saves memory, costs branch reuse).",
    )
    swa_eviction_policy: str = knob(
        "tail_first",
        "Which SWA KV the prefix cache gives up first under SWA pool pressure: tail_first "
        "(SWA no future match reads, then the window tails, least recently used first; full "
        "KV is kept) or lru (SGLang's plain SWA LRU).",
        choices=SWA_EVICTION_POLICIES,
    )
    tombstone_repair: str = knob(
        "auto",
        "auto: a prefix whose SWA KV was freed is reused by recomputing the few tokens that "
        "rebuild its tail window from the cached full KV, when that is at most half of what "
        "it saves; off: reuse only the window-valid prefix.",
        choices=TOMBSTONE_REPAIR_MODES,
    )
    # docs/design.md §9.9
    host_kv_bytes: int | None = knob(
        None,
        "Host-memory KV tier of one worker, in bytes: device eviction moves KV there instead of "
        "dropping it, and a request loads it back instead of recomputing it when that is "
        "cheaper; 0: no tier; unset: on CUDA 4x the device KV budget, at most half the node's "
        "available host memory divided by its visible GPUs; on CPU 0.",
        ge=0,
    )
    # docs/design.md §9.9: device eviction offloads whole nodes' interior SWA, and any cached
    # position may become a reuse point, so the host keeps a token's SWA as long as its full KV.
    host_swa_full_tokens_ratio: float = knob(
        1.0,
        "The host tier's SWA tokens = ratio x its full tokens, in (0, 1]; 1: the host keeps a "
        "token's SWA KV as long as its full KV (any cached position can become a reuse point).",
        gt=0,
        le=1,
    )
    host_link_gbps: float = knob(
        50.0,
        "Host-to-device copy bandwidth in gigabytes (not bits) per second, for the load-or-"
        "recompute choice; 50: PCIe Gen5 x16 with pinned memory.",
        gt=0,
    )
    prefill_tflops: float = knob(
        400.0,
        "Effective prefill compute in TFLOP/s (2 x active parameters per token), for the "
        "load-or-recompute choice; 400: an H200's dense bf16 prefill.",
        gt=0,
    )
    max_model_len: int | None = knob(
        None, "Longest prompt + completion; unset: the model's max_position_embeddings.", gt=0,
    )
    seed: int = knob(0, "Sampling seed of each engine.", ge=0)
    # docs/design.md §17
    tensor_parallel_size: int = knob(
        1,
        "Devices one worker replica splits the model over (one rank each; KV budgets and "
        "worker_num_gpus are per rank); > 1: a placement group of that many bundles, the other "
        "ranks as actors in it.",
        ge=1,
    )
    # docs/design.md §18.2
    cuda_graphs: str = knob(
        "auto",
        "auto: capture the decode forward as CUDA graphs on CUDA with the flashinfer backend "
        "(dense models, one rank); off: always eager.",
        choices=CUDA_GRAPH_MODES,
    )
    cuda_graph_batch_sizes: tuple[int, ...] | None = knob(
        None,
        "Decode batch sizes to capture; unset: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to "
        "max_running_requests.",
    )
    # auto is off on CPU: measured, the host work it hides is a few % of a CPU step (§11.8).
    overlap_schedule: str = knob(
        "auto",
        "on: schedule the next step while the current forward runs, its tokens processed one "
        "step late; off: one step at a time; auto: on for CUDA devices, off on CPU (there the "
        "host work it hides is a few percent of a step).",
        choices=OVERLAP_SCHEDULE_MODES,
    )
    # docs/design.md §16
    quantized_weights: str = knob(
        "dequantize",
        "A quantized checkpoint's weights (GPT-OSS's MXFP4 experts; MiMo-V2-Flash's block-FP8 "
        "experts, and its attention and dense linears on one rank): dequantize: to dtype at "
        "load; keep: in memory as stored, multiplied by FlashInfer's kernels on SM90 GPUs, "
        "elsewhere each weight dequantized when it runs (about a quarter of GPT-OSS's bf16 "
        "bytes, half of MiMo's).",
        choices=QUANTIZED_WEIGHTS_MODES,
    )
    # docs/design.md §19
    compile: str = knob(
        "auto",
        "auto: prepare the model once at load — on CPU the linear weights are packed for "
        "oneDNN (faster small-batch matmuls) and, for models of 20 M parameters or more, the "
        "code between them is compiled with torch.compile (needs a C++ compiler; without one "
        "the packed model runs eagerly); on GPU the dense parts are compiled; attention stays "
        "an opaque op, and the compile happens in a warm-up before the replica reports "
        "healthy; off: plain eager PyTorch.",
        choices=COMPILE_MODES,
    )
    # docs/design.md §19
    small_step_kernel: str = knob(
        "auto",
        "CPU, where compile packs the linear weights: keep beside each packed float32 weight a "
        "copy in 16-column panels and multiply steps of few rows (up to 64 on one torch "
        "thread, 6 on more) with a C kernel that streams the weight once — decode at "
        "concurrency 1-8 runs its linears 1.3-1.9x faster than through oneDNN's packed "
        "layout — at the cost of the linear weights' memory once more (needs a C compiler; "
        "without one, logged, the packed weights take every step). auto: on for an engine on one "
        "torch thread (the measured case) when the copies fit in a quarter of the memory "
        "available at load; on; off.",
        choices=SMALL_STEP_KERNEL_MODES,
    )
    # docs/design.md §22
    standin_tokens_per_s: float | None = knob(
        None,
        "Benchmarks only: replace the model's forward with a compute-free stand-in emitting "
        "tokens at this rate per request (tokens drawn from the model's real vocabulary; no "
        "weights or KV buffers are loaded). Unset: the model runs.",
        gt=0,
    )

    def __post_init__(self) -> None:
        problems = [
            p for name, (_, spec) in KNOBS.items() if (p := spec.problem(name, getattr(self, name)))
        ]
        if not problems:  # the rules between fields assume each field is valid
            problems = _rule_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))


def _knobs() -> dict[str, tuple[Any, Knob]]:
    hints = get_type_hints(EngineConfig)
    return {f.name: (hints[f.name], f.metadata[_KNOB]) for f in fields(EngineConfig)}


# Field name -> (type, `Knob`) in declaration order: what the edges make their fields from.
KNOBS = _knobs()


def _rule_problems(config: EngineConfig) -> list[str]:
    """The rules between fields, each message naming the fields to change."""
    problems = []
    page, on_cuda = config.page_size, config.device.startswith("cuda")
    if page & (page - 1):
        problems.append(f"page_size must be a power of two (got {page}); try {1 << (page.bit_length() - 1)}")
    if config.attention_backend == "flashinfer" and not on_cuda:
        problems.append(
            "attention_backend='flashinfer' runs on GPUs only; set device: cuda or attention_backend: torch"
        )
    n = config.tensor_parallel_size
    if n > 1 and config.device.startswith("cuda:"):
        problems.append(
            f"device={config.device!r} names one GPU but tensor_parallel_size={n} needs {n}: set "
            "device: cuda (rank r uses the r-th GPU it sees)"
        )
    if config.kv_cache_bytes is not None and config.max_total_tokens is not None:
        problems.append("set one of kv_cache_bytes or max_total_tokens, not both")
    if config.max_total_tokens is not None and config.max_total_tokens < page:
        problems.append(f"max_total_tokens ({config.max_total_tokens}) is less than one page (page_size={page})")
    if config.host_kv_bytes and n > 1:
        problems.append(
            f"host_kv_bytes={config.host_kv_bytes} with tensor_parallel_size={n}: the host KV "
            "tier runs on one rank only for now; set host_kv_bytes: 0 or tensor_parallel_size: 1"
        )
    if config.host_kv_bytes and not config.enable_radix_cache:
        problems.append(
            "host_kv_bytes needs the radix cache (enable_radix_cache: true): the host tier holds "
            "what the prefix cache evicts"
        )
    if config.standin_tokens_per_s is not None and (n > 1 or config.host_kv_bytes):
        problems.append(
            "standin_tokens_per_s (the benchmarks' compute-free stand-in) runs one rank without a "
            "host KV tier: set tensor_parallel_size: 1 and host_kv_bytes: 0"
        )
    if config.max_num_batched_tokens < config.max_running_requests:
        problems.append(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_running_requests "
            f"({config.max_running_requests}): every running request decodes one token per step; "
            "raise max_num_batched_tokens or lower max_running_requests"
        )
    return problems


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

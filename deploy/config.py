"""`ServeConfig`: the validated config of one swaserve application (docs/design.md §3).

Everything a user sets — in a bare YAML mapping, in the `args` of a Ray Serve config file, in the
Helm chart's `serve.config` values or through the CLI — lands here, is validated once, and is
converted once: `to_engine_config()` for the worker engine, `worker_deployment_options()` for the
Ray Serve options of the worker deployment. Ray Serve calls our builder as
`deploy.app:build_app(args)` with `args` = the fields below.

    applications:
      - name: swaserve
        import_path: deploy.app:build_app
        args: {model: tiny, routing: swa_prefix, page_size: 16,
               autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 16}}

The API key is the one secret here: it is read from `SWASERVE_API_KEY` (this module is the only
place that reads the environment) so that it never has to be written into a config file or into
the RayService object on Kubernetes. There the key is a file instead, named by
`SWASERVE_API_KEY_FILE` and mounted only in the pods that host the ingress; the ingress replica
reads it when it starts (`api_key_from_file`), so it is in no Ray object either.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from router.policies import DEFAULT_POLICY, POLICY_NAMES
from worker.config import (
    COMPILE_MODES,
    CUDA_GRAPH_MODES,
    OVERLAP_SCHEDULE_MODES,
    SWA_EVICTION_POLICIES,
    TOMBSTONE_REPAIR_MODES,
    EngineConfig,
)

# Names the Serve config files, the Helm chart and `deploy.app` share.
APP_NAME = "swaserve"
APP_IMPORT_PATH = "deploy.app:build_app"
INGRESS_DEPLOYMENT = "Ingress"
WORKER_DEPLOYMENT = "Worker"
API_KEY_ENV = "SWASERVE_API_KEY"
API_KEY_FILE_ENV = "SWASERVE_API_KEY_FILE"

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token prompt is ~0.5 MB of JSON text

RoutingPolicy = Literal[POLICY_NAMES]  # type: ignore[valid-type]  # router.policies names them
Dtype = Literal["float32", "bfloat16", "float16"]
AttentionBackend = Literal["torch", "flashinfer"]
PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]
SwaEvictionPolicy = Literal[SWA_EVICTION_POLICIES]  # type: ignore[valid-type]
TombstoneRepair = Literal[TOMBSTONE_REPAIR_MODES]  # type: ignore[valid-type]
CudaGraphs = Literal[CUDA_GRAPH_MODES]  # type: ignore[valid-type]
OverlapSchedule = Literal[OVERLAP_SCHEDULE_MODES]  # type: ignore[valid-type]
CompileMode = Literal[COMPILE_MODES]  # type: ignore[valid-type]


def _api_key_from_env() -> SecretStr | None:
    value = os.environ.get(API_KEY_ENV, "").strip()
    return SecretStr(value) if value else None


def api_key_from_file() -> str | None:
    """The key in the file `SWASERVE_API_KEY_FILE` names; None when that variable is unset.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is empty. Both fail closed: a key was meant, so nothing serves
            without it.
    """
    path = os.environ.get(API_KEY_FILE_ENV, "").strip()
    if not path:
        return None
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"{API_KEY_FILE_ENV}={path} names an empty file")
    return key


class AutoscalingSettings(BaseModel):
    """Ray Serve autoscaling of the worker deployment (the default queue-length policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(
        1,
        ge=0,
        description="Fewest worker replicas; 0 allows scale-to-zero (cold start = model load).",
    )
    max_replicas: int = Field(
        4,
        ge=1,
        description="Most worker replicas; on Kubernetes also the GPU worker group's maxReplicas.",
    )
    target_ongoing_requests: float = Field(
        16.0,
        gt=0,
        description=(
            "Ongoing (running + queued in the engine) requests per replica the autoscaler aims for. "
            "Keep it at or below the number of requests one replica's KV pools hold at your typical "
            "length, so that KV pressure shows up as queueing and triggers scale-up."
        ),
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Seconds demand must stay above target before replicas are added."
    )
    downscale_delay_s: float = Field(
        600.0,
        ge=0,
        description="Seconds demand must stay below target before replicas are removed (keeps warm caches).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscaling.max_replicas ({self.max_replicas}) must be >= autoscaling.min_replicas "
                f"({self.min_replicas}): raise max_replicas or lower min_replicas"
            )
        return self


class ServeConfig(BaseModel):
    """A swaserve application: model, engine, worker placement, scaling, routing, HTTP limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- model and engine (-> EngineConfig) -------------------------------------------------
    model: str = Field(
        "tiny",
        min_length=1,
        description="'tiny' (the built-in test model) or a local Hugging Face model directory.",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="The model id clients send and /v1/models lists; unset: the `model` value.",
    )
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Engine device: cpu, cuda or cuda:N."
    )
    dtype: Dtype = Field("float32", description="Weights and KV dtype.")
    attention_backend: AttentionBackend = Field(
        "torch", description="torch (CPU and GPU reference) or flashinfer (GPU only)."
    )
    page_size: int = Field(
        16,
        ge=1,
        description="Tokens per KV page (power of two); the unit of allocation, cache events and routing.",
    )
    kv_cache_bytes: int | None = Field(
        None,
        gt=0,
        description="KV byte budget of one worker; unset: derived from max_total_tokens or the engine default.",
    )
    max_total_tokens: int | None = Field(
        None, gt=0, description="Full-pool tokens of one worker (exclusive with kv_cache_bytes)."
    )
    swa_full_tokens_ratio: float = Field(
        0.8, gt=0, le=1, description="SWA pool tokens = ratio x full pool tokens, in (0, 1]."
    )
    disable_hybrid_swa_memory: bool = Field(
        False, description="One pool for all layers: SWA layers keep all their KV (no SWA freeing)."
    )
    enable_radix_cache: bool = Field(
        True, description="Prefix (radix) cache; off: chunk cache only."
    )
    max_num_batched_tokens: int = Field(
        1024,
        ge=1,
        description=(
            "Tokens one engine step feeds, decodes included (vLLM's knob): every decode first, "
            "prefill chunks fill the rest (>= max_running_requests; GPUs want 8192)."
        ),
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens prefilled per step; unset: what max_num_batched_tokens leaves after the decodes.",
    )
    max_running_requests: int = Field(
        64, ge=1, description="Most requests decoding together in one worker."
    )
    swa_eviction_interval: int = Field(
        128,
        ge=1,
        description="Decode frees out-of-window SWA KV once this many tokens left the window.",
    )
    eager_swa_free: bool = Field(
        False,
        description="Free SWA KV of unfinished chunked prefills at once (saves memory, costs branch reuse).",
    )
    swa_eviction_policy: SwaEvictionPolicy = Field(
        "tail_first",
        description=(
            "Which SWA KV the prefix cache gives up first under SWA pool pressure: tail_first "
            "(SWA no future match reads, then the window tails, least recently used first; full "
            "KV is kept) or lru (SGLang's plain SWA LRU)."
        ),
    )
    tombstone_repair: TombstoneRepair = Field(
        "auto",
        description=(
            "auto: a prefix whose SWA KV was freed is reused by recomputing the few tokens that "
            "rebuild its tail window from the cached full KV, when that is at most half of what "
            "it saves; off: reuse only the window-valid prefix."
        ),
    )
    overlap_schedule: OverlapSchedule = Field(
        "auto",
        description=(
            "on: schedule the next step while the current forward runs, its tokens processed one "
            "step late; off: one step at a time; auto: on for CUDA devices, off on CPU (there the "
            "host work it hides is a few percent of a step)."
        ),
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt + completion; unset: the model's max_position_embeddings.",
    )
    seed: int = Field(0, ge=0, description="Sampling seed of each engine.")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="Devices one worker replica splits the model over (one rank each; KV budgets and worker_num_gpus are per rank); > 1: a placement group of that many bundles, the other ranks as actors in it.",
    )  # fmt: skip
    cuda_graphs: CudaGraphs = Field(
        "auto",
        description=(
            "auto: capture the decode forward as CUDA graphs on CUDA with the flashinfer backend "
            "(dense models, one rank); off: always eager."
        ),
    )
    cuda_graph_batch_sizes: tuple[int, ...] | None = Field(
        None,
        description="Decode batch sizes to capture; unset: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to max_running_requests.",
    )

    compile: CompileMode = Field(
        "auto",
        description=(
            "auto: prepare the model once at load — on CPU the linear weights are packed for "
            "oneDNN (faster small-batch matmuls) and, for models of 20 M parameters or more, the "
            "code between them is compiled with torch.compile (needs a C++ compiler; without one "
            "the packed model runs eagerly); on GPU the dense parts are compiled; attention stays "
            "an opaque op, and the compile happens in a warm-up before the replica reports "
            "healthy; off: plain eager PyTorch."
        ),
    )

    engine_process: bool = Field(
        True,
        description=(
            "Step the engine in a child process of each worker replica (one rank), so that the "
            "replica's own Python (Ray, Serve, streaming) never holds the GIL the step loop needs; "
            "false: on a thread of the replica's process. Tensor parallelism always uses a thread."
        ),
    )
    engine_niceness: int | None = Field(
        -5,
        ge=-20,
        le=19,
        description=(
            "Niceness of each worker's engine process (with engine_process): below the replicas' "
            "0, the step loop every stream waits on gets the CPU first when the HTTP side, Ray "
            "and other processes want more than is free. Lowering niceness needs CAP_SYS_NICE "
            "(root, or the capability); without it the engine keeps 0 and logs why. null: keep "
            "the replica's without trying."
        ),
    )

    # -- worker deployment (-> Ray Serve options) ------------------------------------------
    workers: int = Field(
        1, ge=1, description="Fixed number of worker replicas; used only when autoscaling is unset."
    )
    autoscaling: AutoscalingSettings | None = Field(
        None,
        description="Autoscale the worker deployment between bounds; unset: exactly `workers` replicas.",
    )
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Most requests Serve sends to one worker replica at once (keep >= max_running_requests to fill batches).",
    )
    max_queued_requests: int | None = Field(
        None,
        ge=1,
        description="Most requests waiting at the ingress for a worker; beyond it callers get 503. Unset: unbounded.",
    )
    worker_num_cpus: float = Field(
        1.0, ge=0, description="CPUs Ray reserves for each worker replica."
    )
    worker_num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs Ray reserves for each worker replica (> 0 when device is cuda); per rank with tensor parallelism (1).",
    )
    rank_num_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs Ray reserves for each rank actor besides the replica (tensor_parallel_size > 1).",
    )
    placement_group_strategy: PlacementStrategy = Field(
        "STRICT_PACK",
        description="How a replica's tensor-parallel bundles are placed; STRICT_PACK keeps the ranks on one node.",
    )

    # -- routing and HTTP -------------------------------------------------------------------
    routing: RoutingPolicy = Field(
        DEFAULT_POLICY,
        description="Placement policy: swa_prefix (window-valid prefix match), prefix, least_loaded, round_robin.",
    )
    api_key: SecretStr | None = Field(
        default_factory=_api_key_from_env,
        description=f"Bearer token clients must send; unset: read from env {API_KEY_ENV}; empty: no auth.",
    )
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES,
        ge=1024,
        description="Largest HTTP request body accepted (larger: 413).",
    )

    # -- validators ---------------------------------------------------------------------------

    @field_validator("page_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(
                f"page_size must be a power of two (got {v}); try {1 << (v.bit_length() - 1)}"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # -- conversions --------------------------------------------------------------------------

    def to_engine_config(self) -> EngineConfig:
        """The worker's frozen `EngineConfig` (every EngineConfig field has a same-named field here)."""
        return EngineConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        )

    def worker_deployment_options(self) -> dict[str, Any]:
        """Ray Serve options of the worker deployment: `@serve.deployment(**this)` / YAML `deployments`.

        NOTE: a YAML `deployments` entry *replaces* `ray_actor_options` and `autoscaling_config`
        whole (missing keys fall back to Ray's defaults, not to the code's), so config files carry
        every key returned here.
        """
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {
                "num_cpus": self.worker_num_cpus,
                "num_gpus": self.worker_num_gpus,
            },
        }
        if self.autoscaling is None:
            options["num_replicas"] = self.workers
        else:
            options["autoscaling_config"] = self.autoscaling.model_dump()
        if self.max_queued_requests is not None:
            options["max_queued_requests"] = self.max_queued_requests
        if self.tensor_parallel_size > 1:
            options["placement_group_bundles"] = self.placement_group_bundles()
            options["placement_group_strategy"] = self.placement_group_strategy
        return options

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """One bundle per rank: the replica (rank 0) in the first, a rank actor in each other;
        a GPU each on CUDA, fractional CPUs on CPU (docs/design.md §17.4)."""

        def bundle(cpus: float) -> dict[str, float]:
            b = {"CPU": cpus, "GPU": self.worker_num_gpus}
            return {k: v for k, v in b.items() if v > 0}  # Ray refuses zero-sized resources

        ranks = [bundle(self.rank_num_cpus) for _ in range(self.tensor_parallel_size - 1)]
        return [bundle(self.worker_num_cpus), *ranks]

    def to_args(self) -> dict[str, Any]:
        """Plain JSON-able `args` for `build_app` (the API key in clear text when set).

        `workers` is left out when autoscaling is set: the two are exclusive in a config.
        """
        exclude = {"api_key"} | ({"workers"} if self.autoscaling is not None else set())
        args = self.model_dump(mode="json", exclude=exclude)
        if self.api_key is not None:
            args["api_key"] = self.api_key.get_secret_value()
        return args

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        """Load a bare ServeConfig mapping, or a Ray Serve config file (our application's `args`).

        A Ray Serve file is also checked against Ray's schema, strictly (unknown keys are errors),
        and its worker `deployments` entry must agree with the args.
        """
        from deploy.serve_file import load_serve_config  # lazy: imports ray.serve

        return load_serve_config(path)


def _problems(cfg: ServeConfig) -> list[str]:
    """Cross-field rules, each message naming the fields to change."""
    problems = []
    on_cuda = cfg.device.startswith("cuda")
    if on_cuda and cfg.worker_num_gpus <= 0:
        problems.append(
            f"device={cfg.device!r} needs worker_num_gpus > 0 so Ray gives each worker a GPU; "
            "set worker_num_gpus: 1"
        )
    if not on_cuda and cfg.worker_num_gpus > 0:
        problems.append(
            f"device='cpu' with worker_num_gpus={cfg.worker_num_gpus} reserves GPUs the engine never "
            "uses; set device: cuda or worker_num_gpus: 0"
        )
    if cfg.attention_backend == "flashinfer" and not on_cuda:
        problems.append(
            "attention_backend='flashinfer' runs on GPUs only; set device: cuda or attention_backend: torch"
        )
    problems += _tp_problems(cfg, on_cuda)
    if cfg.kv_cache_bytes is not None and cfg.max_total_tokens is not None:
        problems.append("set one of kv_cache_bytes or max_total_tokens, not both")
    if cfg.max_total_tokens is not None and cfg.max_total_tokens < cfg.page_size:
        problems.append(
            f"max_total_tokens ({cfg.max_total_tokens}) is less than one page (page_size={cfg.page_size})"
        )
    if cfg.max_num_batched_tokens < cfg.max_running_requests:
        problems.append(
            f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) is below max_running_requests "
            f"({cfg.max_running_requests}): every running request decodes one token per step; "
            "raise max_num_batched_tokens or lower max_running_requests"
        )
    if cfg.autoscaling is not None and "workers" in cfg.model_fields_set:
        problems.append("set either workers (a fixed count) or autoscaling (bounds), not both")
    target = cfg.autoscaling.target_ongoing_requests if cfg.autoscaling else None
    if target is not None and target > cfg.max_ongoing_requests:
        problems.append(
            f"autoscaling.target_ongoing_requests ({target:g}) exceeds max_ongoing_requests "
            f"({cfg.max_ongoing_requests}), so a replica never sees enough requests to scale up; "
            "lower the target or raise max_ongoing_requests"
        )
    return problems


def _tp_problems(cfg: ServeConfig, on_cuda: bool) -> list[str]:
    n = cfg.tensor_parallel_size
    if n == 1:
        return []
    problems = []
    if on_cuda and cfg.worker_num_gpus != 1:
        problems.append(
            f"tensor_parallel_size={n} runs one rank per GPU: set worker_num_gpus: 1 (the worker "
            f"pod then requests {n} GPUs), not {cfg.worker_num_gpus:g}"
        )
    if cfg.device.startswith("cuda:"):
        problems.append(
            f"device={cfg.device!r} names one GPU but tensor_parallel_size={n} needs {n}: set device: cuda"
        )
    if not on_cuda and cfg.worker_num_cpus <= 0:
        problems.append(f"tensor_parallel_size={n} on CPU reserves CPU bundles: set worker_num_cpus > 0")
    return problems

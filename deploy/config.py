"""`ServeConfig`: the validated config of one swaserve application (docs/design.md §3).

Everything a user sets — in a bare YAML mapping, in the `args` of a Ray Serve config file, in the
Helm chart's `serve.config` values or through the CLI — lands here, is validated once, and is
converted once: `engine` for the worker engine, `worker_deployment_options()` for the Ray Serve
options of the worker deployment. Ray Serve calls our builder as `deploy.app:build_app(args)` with
`args` = the fields of this model, flat: the engine knobs (`EngineConfig`'s fields, declared with
their defaults, descriptions and bounds in `worker/config.py`; made into pydantic fields here)
beside placement, scaling, routing and HTTP.

    applications:
      - name: swaserve
        import_path: deploy.app:build_app
        args: {model: tiny, routing: swa_prefix, page_size: 16,
               autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 16}}

The API key is the one secret here (with `metrics_key`, the scrapers' key, read the same way from
`SWASERVE_METRICS_KEY`): it is read from `SWASERVE_API_KEY` (this module is the only place that
reads the environment) so that it never has to be written into a config file or into the
RayService object on Kubernetes. There the key is a file instead, named by
`SWASERVE_API_KEY_FILE` and mounted only in the pods that host the ingress; the ingress replica
reads it when it starts (`api_key_from_file`), so it is in no Ray object either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    create_model,
    model_validator,
)

from router.policies import DEFAULT_POLICY, POLICY_NAMES
from worker.config import KNOBS, EngineConfig

# Names the Serve config files, the Helm chart and `deploy.app` share.
APP_NAME = "swaserve"
APP_IMPORT_PATH = "deploy.app:build_app"
INGRESS_DEPLOYMENT = "Ingress"
WORKER_DEPLOYMENT = "Worker"
API_KEY_ENV = "SWASERVE_API_KEY"
API_KEY_FILE_ENV = "SWASERVE_API_KEY_FILE"
METRICS_KEY_ENV = "SWASERVE_METRICS_KEY"

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token prompt is ~0.5 MB of JSON text

RoutingPolicy = Literal[POLICY_NAMES]  # type: ignore[valid-type]  # router.policies names them
PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


def _api_key_from_env() -> SecretStr | None:
    value = os.environ.get(API_KEY_ENV, "").strip()
    return SecretStr(value) if value else None


def _metrics_key_from_env() -> SecretStr | None:
    value = os.environ.get(METRICS_KEY_ENV, "").strip()
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


def _engine_fields_model() -> type[BaseModel]:
    """A frozen model with one field per `EngineConfig` field: its name, type, default,
    description and bounds; a field with choices takes exactly those (`Literal`)."""
    defaults = EngineConfig()
    fields: dict[str, Any] = {}
    for name, (kind, knob) in KNOBS.items():
        if knob.choices is not None:
            kind = Literal[knob.choices]
        field = Field(getattr(defaults, name), description=knob.description, **knob.bounds())
        fields[name] = (kind, field)
    config = ConfigDict(extra="forbid", frozen=True)
    return create_model("EngineFields", __config__=config, __module__=__name__, **fields)


# NOTE: the engine fields are made at import from `EngineConfig` (declared once, there), so type
# checkers cannot see them on `ServeConfig`: deploy code reads engine values from `cfg.engine`.
if TYPE_CHECKING:
    EngineFields = BaseModel
else:
    EngineFields = _engine_fields_model()


class ServeConfig(EngineFields):
    """A swaserve application: model, engine, worker placement, scaling, routing, HTTP limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- beside the engine fields (EngineFields): the served name, how the engine runs -------
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="The model id clients send and /v1/models lists; unset: the `model` value.",
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
    graceful_shutdown_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a stopping worker replica (scale-down, upgrade, `swaserve serve` on SIGTERM) keeps serving the requests it has; it takes no new ones. A Serve file's Worker entry may set it instead.",
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
    metrics_auth: bool = Field(
        True,
        description=(
            "/metrics asks for a bearer token (the API key or metrics_key) whenever either is "
            "set; false: /metrics answers without one (a scraper on a closed network). /health "
            "never asks."
        ),
    )
    metrics_key: SecretStr | None = Field(
        default_factory=_metrics_key_from_env,
        description=(
            f"A bearer token for /metrics alone (Prometheus's `authorization: credentials`), so the "
            f"scraper holds no key that can generate; /metrics takes it or the API key. Unset: read "
            f"from env {METRICS_KEY_ENV}."
        ),
    )
    ingress_replicas: int = Field(
        1,
        ge=1,
        description=(
            "Ingress replicas (HTTP parsing, tokenizing, streaming), each with its own admission "
            "bounds and event loop. `swaserve serve` binds them all to its one port (the kernel "
            "spreads connections over them); behind Serve's HTTP proxy (`--serve-proxy`, a "
            "cluster) the proxy spreads requests over them."
        ),
    )
    max_inflight_sequences: int = Field(
        1024,
        ge=1,
        description=(
            "Sequences (prompts x choices, best_of counted) one ingress replica holds in flight; "
            "a request over what is left gets 429 + Retry-After, one larger than this alone 400."
        ),
    )
    max_inflight_tokens: int = Field(
        8_388_608,
        ge=1,
        description=(
            "Tokens (each prompt once plus max_tokens for each of its choices) one ingress "
            "replica holds in flight; a request over what is left gets 429 + Retry-After, one "
            "larger than this alone 400."
        ),
    )
    request_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description=(
            "Longest a generation request may take from arrival; past it the request is aborted "
            "on its worker (KV freed) and answered 504 (a stream: an error event). null: no limit."
        ),
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Longest one response write may wait on a client that stops reading; past it the "
            "connection is closed and the request aborted on its worker (KV freed)."
        ),
    )

    _engine: EngineConfig = PrivateAttr()

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        # NOTE: EngineConfig checks the engine fields (ConfigError, a ValueError: pydantic reports
        # it as this model's error); placement is checked here, once the engine is valid.
        self._engine = EngineConfig(**{name: getattr(self, name) for name in KNOBS})
        problems = _placement_problems(self, self._engine)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def engine(self) -> EngineConfig:
        """The worker's frozen `EngineConfig`, made once when this config was validated."""
        return self._engine

    def worker_deployment_options(self) -> dict[str, Any]:
        """Ray Serve options of the worker deployment: `@serve.deployment(**this)` / YAML `deployments`.

        NOTE: a YAML `deployments` entry *replaces* `ray_actor_options` and `autoscaling_config`
        whole (missing keys fall back to Ray's defaults, not to the code's), so config files carry
        every key returned here.
        """
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
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
        if self.engine.tensor_parallel_size > 1:
            options["placement_group_bundles"] = self.placement_group_bundles()
            options["placement_group_strategy"] = self.placement_group_strategy
        return options

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """One bundle per rank: the replica (rank 0) in the first, a rank actor in each other;
        a GPU each on CUDA, fractional CPUs on CPU (docs/design.md §17.4)."""

        def bundle(cpus: float) -> dict[str, float]:
            b = {"CPU": cpus, "GPU": self.worker_num_gpus}
            return {k: v for k, v in b.items() if v > 0}  # Ray refuses zero-sized resources

        ranks = [bundle(self.rank_num_cpus) for _ in range(self.engine.tensor_parallel_size - 1)]
        return [bundle(self.worker_num_cpus), *ranks]


def _placement_problems(cfg: ServeConfig, engine: EngineConfig) -> list[str]:
    """Rules between the engine and the resources Ray gives it, and between the scaling fields;
    each message names the fields to change."""
    problems = _gpu_problems(cfg, engine) + _tp_problems(cfg, engine)
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


def _gpu_problems(cfg: ServeConfig, engine: EngineConfig) -> list[str]:
    on_cuda = engine.device.startswith("cuda")
    if on_cuda and cfg.worker_num_gpus <= 0:
        return [
            f"device={engine.device!r} needs worker_num_gpus > 0 so Ray gives each worker a GPU; "
            "set worker_num_gpus: 1"
        ]
    if not on_cuda and cfg.worker_num_gpus > 0:
        return [
            f"device='cpu' with worker_num_gpus={cfg.worker_num_gpus} reserves GPUs the engine never "
            "uses; set device: cuda or worker_num_gpus: 0"
        ]
    return []


def _tp_problems(cfg: ServeConfig, engine: EngineConfig) -> list[str]:
    n = engine.tensor_parallel_size
    if n == 1:
        return []
    on_cuda = engine.device.startswith("cuda")
    if on_cuda and cfg.worker_num_gpus != 1:
        return [
            f"tensor_parallel_size={n} runs one rank per GPU: set worker_num_gpus: 1 (the worker "
            f"pod then requests {n} GPUs), not {cfg.worker_num_gpus:g}"
        ]
    if not on_cuda and cfg.worker_num_cpus <= 0:
        return [f"tensor_parallel_size={n} on CPU reserves CPU bundles: set worker_num_cpus > 0"]
    return []

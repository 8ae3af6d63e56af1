"""The Ray Serve application: an OpenAI ingress in front of worker replicas that each own an engine.

Usable wherever Ray takes an application builder — `serve run`, `serve deploy`, KubeRay's
`serveConfigV2` — with the fields of `deploy.config.ServeConfig` as `args`:

    applications:
      - name: swaserve
        route_prefix: /
        import_path: deploy.app:build_app
        args: {model: tiny, routing: swa_prefix, workers: 2, worker_num_cpus: 0.5}

In Python: `serve.run(build_app_from_config(ServeConfig(model="tiny")), name="swaserve")`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deploy.config import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, ServeConfig
from deploy.openai.admission import AdmissionLimits
from deploy.openai.ingress import IngressDeployment, IngressOptions
from deploy.openai.service import ServiceOptions
from deploy.replica.deployment import EngineFactory, WorkerDeployment, WorkerOptions


@dataclass(frozen=True)
class IngressSettings:
    """Ingress knobs that are not `ServeConfig` fields; the defaults suit both CPU and GPU."""

    max_queued: int = 256  # at least: requests queued for a busy ingress replica; beyond: 503
    retry_after_s: int = 1
    num_cpus: float = 0.25  # tokenization and SSE only; a fraction keeps small hosts schedulable


# Both deployments run our code on the replica's own event loop, where Serve's HTTP server
# (direct ingress), its gRPC server and client are: by default Serve gives user code a loop of
# its own on another thread, and every SSE message, request and stream item crossed between the
# two (docs/design.md §4.2). Set per deployment (the replica process's environment); a YAML
# `deployments` entry that gives `ray_actor_options` replaces it, and the replica then runs with
# Serve's default (correct, a little slower).
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # Serve exports a replica's cached request metrics (and its handles') every 100 ms by
    # default: ten wake-ups a second of each replica's loop, idle or not. Prometheus scrapes
    # every few seconds and Ray's metrics agent exports every 10 s: once a second loses nothing.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# The worker's calls come from our ingress, which logs each HTTP request: Serve's access-log line
# per worker call (a file write and a stderr write on the replica's loop) says nothing more.
WORKER_LOGGING = {"enable_access_log": False}

ROUTER_CLASS = "router.serve_router:SwaPrefixRequestRouter"
ROUTING_STATS_PERIOD_S = 1.0

# Worker lifecycle defaults; a YAML `deployments: [{name: Worker, ...}]` entry overrides them (and
# the config's `graceful_shutdown_timeout_s`).
WORKER_LIFECYCLE = {
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 60.0,  # a long prefill holds the GIL for a while on CPU
    "graceful_shutdown_wait_loop_s": 2.0,
}


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder (`import_path: deploy.app:build_app`, `args` = ServeConfig)."""
    return build_app_from_config(ServeConfig.model_validate(args or {}))


def build_app_from_config(
    cfg: ServeConfig,
    ingress: IngressSettings | None = None,
    engine_factory: EngineFactory | None = None,
) -> Application:
    """The application for one validated config (the CLI and tests call this directly).

    `engine_factory(EngineConfig)` replaces `AsyncEngine` in the workers (tests: a fake engine;
    it must be importable in the worker processes).
    """
    ingress = ingress or IngressSettings()
    worker_opts = worker_options(cfg)
    actor = worker_opts.setdefault("ray_actor_options", {})
    actor["runtime_env"] = {"env_vars": REPLICA_ENV}
    worker_opts.setdefault("logging_config", WORKER_LOGGING)
    worker = serve.deployment(name=WORKER_DEPLOYMENT, **worker_opts)(WorkerDeployment)
    front = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.ingress_replicas,
        # A generation request is one sequence at least (admission counts them): the rest is
        # headroom for /health, /metrics and the utility routes.
        max_ongoing_requests=cfg.max_inflight_sequences + 32,
        # Beyond: 503, never a hang. NOTE: Serve's direct ingress counts a request as queued from
        # its arrival until it holds a slot, free slots or not, so a burst of new streams larger
        # than this was answered 503 while admission would have taken it (measured: 330 of
        # 1,024 streams started at once, `bench serving-ceiling`); never below what admits.
        max_queued_requests=max(ingress.max_queued, cfg.max_inflight_sequences),
        ray_actor_options={"num_cpus": ingress.num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
    )(IngressDeployment)
    options = WorkerOptions(engine_process=cfg.engine_process, engine_niceness=cfg.engine_niceness)
    workers = worker.bind(cfg.engine, options, engine_factory)
    app: Application = front.bind(workers, ingress_options(cfg, ingress))
    return app


def worker_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve options of the worker deployment: the config's, lifecycle defaults, the router."""
    options = {**WORKER_LIFECYCLE, **cfg.worker_deployment_options()}
    options["request_router_config"] = request_router_config(cfg)
    return options


def ingress_options(cfg: ServeConfig, ingress: IngressSettings) -> IngressOptions:
    service = ServiceOptions(
        model_name=cfg.served_model_name or cfg.engine.model,
        admission=AdmissionLimits(cfg.max_inflight_sequences, cfg.max_inflight_tokens),
        retry_after_s=ingress.retry_after_s,
        request_timeout_s=cfg.request_timeout_s,
    )
    api_key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
    metrics_key = cfg.metrics_key.get_secret_value() if cfg.metrics_key is not None else None
    return IngressOptions(
        service=service, api_key=api_key or None, max_request_bytes=cfg.max_request_bytes,
        model=cfg.engine.model, metrics_auth=cfg.metrics_auth, metrics_key=metrics_key or None,
        write_timeout_s=cfg.write_timeout_s,
    )  # fmt: skip


def request_router_config(cfg: ServeConfig) -> RequestRouterConfig:
    """Our router in front of the workers, with the config's policy; routing stats every second
    (queue and pool headroom; the cache itself reaches the router through cache events)."""
    # NOTE: RequestRouterConfig is a pydantic model whose stubs mistype these fields.
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
        request_router_kwargs={"policy": cfg.routing},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,  # type: ignore[arg-type]
    )

"""`swaserve serve`: a local Ray cluster on loopback, the app on it, in the foreground until Ctrl-C.

Steps, each announced on stderr: resolve the config (file, then flags on top), prepare the model
(create the tiny model, or check the directory), start Ray bound to 127.0.0.1, start Serve, deploy,
then report worker progress until every worker has its engine loaded and `/health` answers 200.

The ingress replicas listen on `--host/--port` themselves (Serve's direct ingress,
`cluster.ray_local.direct_ingress_env`): HTTP goes client → ingress → worker, without Serve's
HTTP proxy process in between (one process hop and two messages fewer per streamed token;
docs/design.md §4.2). With `ingress_replicas` > 1 every one of them binds the one port
(SO_REUSEPORT: the kernel spreads connections over them). Serve still starts its proxy on the
head node, on another free port; `--serve-proxy` puts the proxy on `--host/--port` instead, as a
Ray Serve deployment on a cluster (the Helm chart) has it. SIGTERM's drain closes every ingress
replica and waits for each one's requests in flight.

SIGTERM (what Kubernetes, systemd and `docker stop` send) or Ctrl-C drains, then stops: the
ingress stops admitting (503 + Retry-After, `/health` 503), the requests in flight get up to the
worker deployment's `graceful_shutdown_timeout_s` to finish, then Serve and Ray shut down and the
command exits 0. A second signal skips what is left of the wait.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from deploy.config import APP_NAME, INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, ServeConfig
from worker.models.model_dir import TINY, resolve_model_dir

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
INGRESS_CPUS = 0.25  # deploy.app.IngressSettings.num_cpus


@dataclass(frozen=True)
class ServeRequest:
    """What the command line asked for (None: not given)."""

    model: str | None = None
    workers: int | None = None
    host: str | None = None
    port: int | None = None
    routing: str | None = None
    device: str | None = None
    config: str | None = None
    num_cpus: int | None = None
    startup_timeout_s: float = 900.0
    serve_proxy: bool = False  # HTTP through Serve's proxy rather than straight to the ingress


@dataclass(frozen=True)
class Plan:
    config: ServeConfig
    host: str
    port: int
    num_cpus: int
    serve_proxy: bool = False

    @property
    def direct_ingress_port(self) -> int | None:
        return None if self.serve_proxy else self.port


class Progress:
    def __init__(self, out: TextIO = sys.stderr) -> None:
        self._out, self._t0 = out, time.monotonic()

    def say(self, message: str) -> None:
        print(f"[swaserve {time.monotonic() - self._t0:6.1f}s] {message}", file=self._out, flush=True)


def plan(req: ServeRequest) -> Plan:
    """The config to serve: the file's (if any), the flags on top, CPU shares fitted to this host.

    Raises:
        ValueError: an invalid config or flag combination (the message says what to change).
    """
    host, port, base = None, None, {}
    if req.config:
        from deploy.serve_file import load_serve_file

        loaded = load_serve_file(req.config)
        host, port = loaded.host, loaded.port
        secrets = {"api_key": loaded.config.api_key, "metrics_key": loaded.config.metrics_key}
        base = loaded.config.model_dump(mode="json", exclude_unset=True, exclude=set(secrets))
        base.update({k: v.get_secret_value() for k, v in secrets.items() if v is not None})
    flags = {"model": req.model, "workers": req.workers, "routing": req.routing, "device": req.device}
    args = {**base, **{k: v for k, v in flags.items() if v is not None}}
    if req.workers is not None:
        args.pop("autoscaling", None)  # --workers asks for a fixed count
    if str(args.get("device", "cpu")).startswith("cuda"):
        args.setdefault("worker_num_gpus", 1)  # one GPU per worker replica
    elif req.device == "cpu":
        args["worker_num_gpus"] = 0
    num_cpus = req.num_cpus or os.cpu_count() or 1
    cfg = ServeConfig.model_validate(args)
    cfg = _fit_cpus(cfg, args, num_cpus)
    _check_gpus(cfg)
    return Plan(cfg, req.host or host or DEFAULT_HOST, req.port or port or DEFAULT_PORT, num_cpus,
                req.serve_proxy)  # fmt: skip


def _fit_cpus(cfg: ServeConfig, args: dict[str, Any], num_cpus: int) -> ServeConfig:
    """On CPU hosts give each worker (each of its tensor-parallel ranks) a fraction of the
    machine unless the config chose one."""
    replicas_max = cfg.autoscaling.max_replicas if cfg.autoscaling else cfg.workers
    replicas_min = cfg.autoscaling.min_replicas if cfg.autoscaling else cfg.workers
    ranks = cfg.engine.tensor_parallel_size
    ingress_cpus = INGRESS_CPUS * cfg.ingress_replicas
    if cfg.engine.device == "cpu" and "worker_num_cpus" not in args:
        share = max(0.05, min(1.0, (num_cpus - ingress_cpus) / max(1, replicas_max * ranks)))
        fitted = {"worker_num_cpus": round(share - 0.005, 2)}
        if ranks > 1 and "rank_num_cpus" not in args:
            fitted["rank_num_cpus"] = fitted["worker_num_cpus"]
        cfg = ServeConfig.model_validate({**args, **fitted})
    per_replica = cfg.worker_num_cpus + (ranks - 1) * cfg.rank_num_cpus
    need = replicas_min * per_replica + ingress_cpus
    if need > num_cpus:
        raise ValueError(
            f"{replicas_min} worker(s) x {per_replica:g} CPUs (worker_num_cpus + rank actors) plus "
            f"the ingress's {ingress_cpus:g} need {need:g} CPUs but the local cluster has "
            f"{num_cpus}; lower worker_num_cpus or --workers, or raise --num-cpus"
        )
    return cfg


def _check_gpus(cfg: ServeConfig) -> None:
    if cfg.worker_num_gpus <= 0:
        return
    import torch

    have = torch.cuda.device_count()
    replicas = cfg.autoscaling.min_replicas if cfg.autoscaling else cfg.workers
    ranks = cfg.engine.tensor_parallel_size
    need = replicas * cfg.worker_num_gpus * ranks
    if need > have:
        raise ValueError(
            f"{replicas} worker(s) x worker_num_gpus={cfg.worker_num_gpus} x tensor_parallel_size="
            f"{ranks} need {need:g} GPUs but this machine has {have}; lower "
            "--workers or use --device cpu"
        )


def prepare_model(model: str, progress: Progress) -> Path:
    if model == TINY:
        progress.say("preparing the built-in tiny model (created once, then reused) ...")
    path = resolve_model_dir(model)  # ConfigError (a ValueError) names what to pass instead
    progress.say(f"model files: {path}")
    return path


def check_port_free(host: str, port: int) -> None:
    """Raises when another process listens on the port. Connections of a server stopped a moment
    ago (TIME_WAIT) do not count: the HTTP listener binds with SO_REUSEADDR, as this check does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port") from None


def free_port(host: str) -> int:
    """A port nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_foreground(req: ServeRequest, out: TextIO = sys.stdout) -> int:
    progress = Progress()
    try:
        p = plan(req)
        check_port_free(p.host, p.port)
        prepare_model(p.config.engine.model, progress)
    except (ValueError, OSError) as e:
        print(f"swaserve serve: {e}", file=sys.stderr)
        return 2
    from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray

    progress.say(f"starting a local Ray cluster on 127.0.0.1 ({p.num_cpus} CPUs) ...")
    cluster = start_local_ray(
        LocalRayConfig(num_cpus=p.num_cpus, direct_ingress_port=p.direct_ingress_port,
                       direct_ingress_replicas=p.config.ingress_replicas)  # fmt: skip
    )
    _quiet_ray_logs()  # after ray.init, which sets up Ray's loggers
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _deploy(p, progress, req.startup_timeout_s)
        url = f"http://{p.host}:{p.port}"
        print(f"swaserve is ready: {url}/v1  (model '{p.config.engine.model}', {_workers(p.config)}, "
              f"routing {p.config.routing}); Ctrl-C stops it", file=out, flush=True)  # fmt: skip
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        progress.say("stopping: new requests get 503, those in flight finish (again: force) ...")
        try:
            _drain(progress, p.config.graceful_shutdown_timeout_s)
        except KeyboardInterrupt:
            progress.say("not waiting for the requests in flight")
        return 0
    except RuntimeError as e:
        print(f"swaserve serve: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once
        _shutdown(cluster, stop_local_ray)
        signal.signal(signal.SIGTERM, previous)
        progress.say("stopped")


def _deploy(p: Plan, progress: Progress, timeout_s: float) -> None:
    from ray import serve

    from deploy.app import build_app_from_config

    if p.serve_proxy:
        proxy_port = p.port
        progress.say(f"starting Serve, its HTTP proxy on {p.host}:{p.port} ...")
    else:
        proxy_port = free_port(p.host)
        n = p.config.ingress_replicas
        who = "the ingress replica" if n == 1 else f"the {n} ingress replicas"
        progress.say(f"starting Serve ({who} will listen on {p.host}:{p.port}; "
                     f"Serve's own proxy on {p.host}:{proxy_port}) ...")  # fmt: skip
    serve.start(http_options={"host": p.host, "port": proxy_port}, proxy_location="HeadOnly")
    _quiet_ray_logs()  # serve.start configures the serve logger
    progress.say(f"deploying {_workers(p.config)}; each loads the model ...")
    app = serve.RunTarget(build_app_from_config(p.config), name=APP_NAME, route_prefix="/")
    serve.run_many([app], wait_for_applications_running=False)  # progress: _wait_running
    _wait_running(progress, timeout_s)
    wait_healthy(f"http://{_probe_host(p.host)}:{p.port}/health", timeout_s)


def _wait_running(progress: Progress, timeout_s: float) -> None:
    from ray import serve

    deadline, last, last_said = time.monotonic() + timeout_s, "", 0.0
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        status = str(getattr(app, "status", "NOT_STARTED"))
        if status.endswith("RUNNING"):
            return
        if app is not None and (status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY")):
            raise RuntimeError(f"deployment failed: {app.message or _deployment_messages(app)}")
        line = _describe(app)
        if line != last or time.monotonic() - last_said > 10:
            progress.say(line)
            last, last_said = line, time.monotonic()
        time.sleep(0.5)
    raise RuntimeError(f"workers not ready after {timeout_s:.0f}s; raise --startup-timeout")


def wait_healthy(url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200 (the endpoint is ready only when the workers are)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own loopback URL
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s")


def _describe(app: Any) -> str:
    if app is None:
        return "waiting for the application to be created ..."
    parts = []
    for name in (WORKER_DEPLOYMENT, INGRESS_DEPLOYMENT):
        dep = app.deployments.get(name)
        if dep is None:
            continue
        states = _replica_states(dep)
        parts.append(f"{name}: {states.get('RUNNING', 0)} running" + "".join(
            f", {v} {k.lower()}" for k, v in sorted(states.items()) if k != "RUNNING"))  # fmt: skip
    return "; ".join(parts) or "deploying ..."


def _drain(progress: Progress, grace_s: float) -> None:
    """Close every ingress replica and wait up to `grace_s` (the worker replicas' own grace, the
    config's `graceful_shutdown_timeout_s`) for their requests in flight.

    NOTE: a handle call reaches one replica of Serve's choosing (no public API names one), so
    `close` goes out in rounds of twice as many calls as there are ingress replicas, until every
    replica Serve reports running has answered at least once and each one's latest count is 0:
    while a call is queued on a replica Serve's router prefers the others, and a replica whose
    gate is closed admits nothing, so its count only falls."""
    from ray import serve

    try:
        ingress = serve.get_app_handle(APP_NAME)
    except Exception:  # noqa: BLE001 - not deployed yet: nothing is in flight
        return
    replicas = max(1, _running_ingress_replicas())
    counts: dict[str, int] = {}
    deadline = time.monotonic() + grace_s
    while True:
        calls = [ingress.close.remote() for _ in range(2 * replicas)]
        counts.update(call.result(timeout_s=30) for call in calls)
        if len(counts) >= replicas and not any(counts.values()):
            progress.say("in-flight requests finished")
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)  # polls the replicas' in-flight counts
    left, unseen = sum(counts.values()), replicas - len(counts)
    progress.say(f"{left} request(s) still running after {grace_s:.0f}s"
                 + (f", {unseen} ingress replica(s) never answered" if unseen > 0 else "")
                 + "; stopping anyway")  # fmt: skip


def _running_ingress_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get(INGRESS_DEPLOYMENT) if app is not None else None
    return 0 if deployment is None else int(_replica_states(deployment).get("RUNNING", 0))


def _replica_states(deployment: Any) -> dict[str, int]:
    """A deployment's replica counts by state name (Serve's keys are `ReplicaState` members)."""
    return {str(k).rsplit(".", 1)[-1]: v for k, v in deployment.replica_states.items()}


def _deployment_messages(app: Any) -> str:
    return "; ".join(f"{n}: {d.message}" for n, d in app.deployments.items() if d.message)


def _shutdown(cluster: Any, stop_local_ray: Any) -> None:
    try:
        from ray import serve

        from cluster.transport import index_actor_name, kill_index_actor

        serve.shutdown()
        kill_index_actor(index_actor_name(APP_NAME, WORKER_DEPLOYMENT))  # detached: not Serve's
    finally:
        stop_local_ray(cluster)


def _workers(cfg: ServeConfig) -> str:
    if cfg.autoscaling:
        return f"{cfg.autoscaling.min_replicas}-{cfg.autoscaling.max_replicas} autoscaled workers"
    return f"{cfg.workers} worker{'s' if cfg.workers != 1 else ''}"


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _quiet_ray_logs() -> None:
    # Ray's INFO lines duplicate our progress, and one of them ("New http_options will not be
    # applied", logged because serve.run re-checks the running instance) reads like an error.
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt

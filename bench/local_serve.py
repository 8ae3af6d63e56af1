"""A benchmark's own Ray Serve: a local Ray cluster with Serve on a free loopback port, and the
swaserve application of one config deployed on it, then deleted (its cache index actor too), so
the next config starts from nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.config import ServeConfig


def free_port() -> int:
    """A loopback TCP port free now (a benchmark's local Serve HTTP port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quiet_ray_logs() -> None:
    """Ray's and Serve's loggers at WARNING: a benchmark's console shows its own progress."""
    import logging

    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextmanager
def local_serve(num_cpus: int, model: str) -> Iterator[str]:
    """Ray with `num_cpus` and Serve on a free loopback port (`model` built first, before any
    worker loads it); yields the base URL; both stopped afterwards, also on errors."""
    from ray import serve

    from cluster.ray_local import LocalRayConfig, local_ray
    from worker.models.model_dir import resolve_model_dir

    resolve_model_dir(model)
    port = free_port()
    with local_ray(LocalRayConfig(num_cpus=num_cpus)):
        quiet_ray_logs()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


@contextmanager
def deployed(
    cfg: ServeConfig, url: str, startup_timeout_s: float
) -> Iterator[tuple[float, dict[str, str]]]:
    """The swaserve app of `cfg` deployed and healthy at `url`; yields the seconds it took and
    the request headers its API key needs; deleted afterwards with its cache index actor."""
    from ray import serve

    from cluster.transport import index_actor_name, kill_index_actor
    from deploy.app import build_app_from_config
    from deploy.config import APP_NAME, WORKER_DEPLOYMENT
    from deploy.serve_local import wait_healthy

    t0 = time.perf_counter()
    serve.run(build_app_from_config(cfg), name=APP_NAME, route_prefix="/")
    try:
        wait_healthy(f"{url}/health", startup_timeout_s)
        headers = (
            {"authorization": f"Bearer {cfg.api_key.get_secret_value()}"} if cfg.api_key else {}
        )
        yield time.perf_counter() - t0, headers
    finally:
        serve.delete(APP_NAME)
        kill_index_actor(index_actor_name(APP_NAME, WORKER_DEPLOYMENT))

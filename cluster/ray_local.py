"""Start and stop a local Ray cluster on loopback (CLI `swaserve serve` and tests).

Ray's environment switches are set here and nowhere else:
- `RAY_AUTH_MODE=disabled`: Ray 2.60 turns token auth on for a new local cluster and writes
  `~/.ray/auth_token`, which then leaks into every later `ray start` on the machine;
- `RAY_USAGE_STATS_ENABLED=0`: no telemetry (and no network attempt);
- `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: Ray otherwise replaces `_node_ip_address="127.0.0.1"`
  by the host's routable address (`services.resolve_ip_for_localhost`); with "clusters" off it
  keeps the loopback address, which is all a single-node cluster needs;
- `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30`: Serve kills and restarts an HTTP proxy that is not
  ready within 3 checks of this (5 s by default), and `serve.start` then fails; a proxy actor
  that imports uvicorn and FastAPI on a busy machine needs longer than 15 s;
- `RAY_worker_niceness=0`: Ray's core worker raises its own niceness by this value at start
  (`nice(worker_niceness)`, default 15), so every actor, our replicas included, would run
  behind any normal-priority process on the machine. 0 leaves replicas at the raylet's
  priority; it only ever lowers priority, so no privilege is needed (a non-root pod too; the
  Helm chart sets the same variable on its pods).
Each cluster gets its own short temp dir (Ray's socket paths must stay under ~107 bytes), so
parallel jobs on one machine do not share sessions; it is removed on stop. The two Ray internals
this needs live in `cluster.ray_private`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cluster import ray_private

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_worker_niceness": "0",
}


_CLUSTERS_DEFAULT = True  # Ray's value on Linux


@dataclass(frozen=True)
class LocalRayConfig:
    num_cpus: int = 2  # logical CPUs; give actors fractional `num_cpus` so several fit
    object_store_memory: int = 256 << 20  # the default takes 30 % of RAM in /dev/shm
    namespace: str | None = None
    temp_root: str = "/tmp"


@dataclass(frozen=True)
class LocalRay:
    """A cluster this process started (stop it with `stop_local_ray`)."""

    temp_dir: str
    address: str


def start_local_ray(config: LocalRayConfig | None = None) -> LocalRay:
    """Start a fresh single-node cluster bound to 127.0.0.1 (no dashboard).

    Raises:
        RuntimeError: Ray is already initialised in this process.
    """
    import ray

    cfg = config or LocalRayConfig()
    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process; stop it (ray.shutdown()) or reuse it"
        )
    os.environ.update(RAY_ENV)
    # NOTE: Ray reads the variable when it is imported, usually before this call; set the
    # constant it became as well (restored by stop_local_ray).
    ray_private.set_clusters_enabled(False)
    temp_dir = tempfile.mkdtemp(prefix="swaray-", dir=cfg.temp_root)
    try:
        ray.init(
            address="local",
            num_cpus=cfg.num_cpus,
            object_store_memory=cfg.object_store_memory,
            include_dashboard=False,
            namespace=cfg.namespace,
            log_to_driver=False,
            **ray_private.loopback_init_kwargs(temp_dir),
        )
    except BaseException:
        ray_private.set_clusters_enabled(_CLUSTERS_DEFAULT)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return LocalRay(temp_dir=temp_dir, address=ray.get_runtime_context().gcs_address)


def stop_local_ray(cluster: LocalRay) -> None:
    """Shut down the cluster `start_local_ray` started and delete its temp dir."""
    import ray

    ray.shutdown()
    ray_private.set_clusters_enabled(_CLUSTERS_DEFAULT)
    # Ray's helper processes (log monitor, agents) exit a moment after shutdown and may still
    # write session files: retry until the directory is really gone (at most ~5 s).
    for _ in range(50):
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        if not os.path.exists(cluster.temp_dir):
            return
        time.sleep(0.1)


@contextmanager
def local_ray(config: LocalRayConfig | None = None) -> Iterator[LocalRay]:
    cluster = start_local_ray(config)
    try:
        yield cluster
    finally:
        stop_local_ray(cluster)

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
  Helm chart sets the same variable on its pods);
- `MALLOC_*` (`MALLOC_ENV` below): glibc malloc keeps a replica's step buffers instead of
  returning them to the OS and faulting them in again every step;
- with `LocalRayConfig.direct_ingress_port` (`swaserve serve`), Serve's direct ingress
  (`direct_ingress_env` below): the ingress replicas listen on that port themselves, all of
  them on the one port, so HTTP no longer passes through Serve's proxy process
  (docs/design.md §4.2).
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

# glibc malloc in every Ray process (read at process start, so the raylet's children inherit
# it): allocations under 32 MiB come from the heap, which is trimmed back to the OS only above
# 4 GB free and grows 256 MiB at a time. A CPU replica allocates and frees its step tensors
# every step; by default each step's large buffers are mmapped or trimmed and faulted in again
# (1.2-1.3 M minor faults and ~2 s of system time per batch-32 run of the 46 M model, against
# ~40 K with these; BENCHMARKS.md "schedule").
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
    "MALLOC_TOP_PAD_": "268435456",
}

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_worker_niceness": "0",
    **MALLOC_ENV,
}


_CLUSTERS_DEFAULT = True  # Ray's value on Linux


@dataclass(frozen=True)
class LocalRayConfig:
    num_cpus: int = 2  # logical CPUs; give actors fractional `num_cpus` so several fit
    object_store_memory: int = 256 << 20  # the default takes 30 % of RAM in /dev/shm
    namespace: str | None = None
    temp_root: str = "/tmp"
    # The ingress replicas serve HTTP on this port themselves (Serve's direct ingress); None:
    # the HTTP port is Serve's proxy's, as `serve.start(http_options=...)` sets it.
    direct_ingress_port: int | None = None
    direct_ingress_replicas: int = 1  # how many ingress replicas share that port


def direct_ingress_env(port: int, replicas: int = 1) -> dict[str, str]:
    """Serve's direct ingress with `replicas` ingress replicas all serving `port`.

    - the port range is [port, port + replicas): Serve allocates each replica a port of its
      own from it (a replica more would find none), but every replica binds `port` itself
      (`SHARED_INGRESS_PORT_ENV`, `cluster.ray_private.direct_ingress_server`: SO_REUSEPORT,
      the kernel spreads connections over them); the others of the range stay unbound;
    - no quarantine of a released port (Serve holds it back ~90 s by default, for HAProxy
      workers still routing to it) and no minimum draining period (30 s by default, for an
      external load balancer to deregister the replica): nothing stands in front of a local
      ingress, and a replacement replica must get a port back at once.
    Serve's controller still starts its proxy on the head node (a fallback it keeps in this
    mode); the caller gives it another port.
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + replicas),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        ray_private.SHARED_INGRESS_PORT_ENV: str(port),
    }


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
    # Read by Serve's controller and replicas, which inherit the raylet's environment (this
    # process's at `ray.init`); restored at stop so a later cluster does not inherit them.
    if cfg.direct_ingress_port is not None:
        _set_env(direct_ingress_env(cfg.direct_ingress_port, cfg.direct_ingress_replicas))
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
        _restore_env()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return LocalRay(temp_dir=temp_dir, address=ray.get_runtime_context().gcs_address)


def stop_local_ray(cluster: LocalRay) -> None:
    """Shut down the cluster `start_local_ray` started and delete its temp dir."""
    import ray

    ray.shutdown()
    ray_private.set_clusters_enabled(_CLUSTERS_DEFAULT)
    _restore_env()
    # Ray's helper processes (log monitor, agents) exit a moment after shutdown and may still
    # write session files: retry until the directory is really gone (at most ~5 s).
    for _ in range(50):
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        if not os.path.exists(cluster.temp_dir):
            return
        time.sleep(0.1)


_SAVED_ENV: dict[str, str | None] = {}  # what `_set_env` replaced, for `_restore_env`


def _set_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        _SAVED_ENV.setdefault(key, os.environ.get(key))
        os.environ[key] = value


def _restore_env() -> None:
    for key, old in _SAVED_ENV.items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    _SAVED_ENV.clear()


@contextmanager
def local_ray(config: LocalRayConfig | None = None) -> Iterator[LocalRay]:
    cluster = start_local_ray(config)
    try:
        yield cluster
    finally:
        stop_local_ray(cluster)

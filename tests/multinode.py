"""A multi-node Ray cluster on this machine, for fault tests: `ray.cluster_utils.Cluster` with a
head and worker nodes, each its own raylet with its own resources, all on 127.0.0.1.

The cluster gets a temp dir of its own (also `RAY_TMPDIR`, where Ray writes its
current-cluster file), so nothing is shared with other Ray runs on the machine; its processes are
found through their raylet's command line (which names that dir) and are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster

from cluster import ray_private
from cluster.ray_local import RAY_ENV

_NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 128 << 20}


@dataclass
class LocalCluster:
    cluster: Cluster
    temp_dir: str
    workers: list[Any] = field(default_factory=list)  # the worker nodes still up, oldest first

    def add_worker_node(self, num_cpus: int = 1) -> Any:
        node = self.cluster.add_node(num_cpus=num_cpus, **_NODE)
        self.workers.append(node)
        return node

    def remove_worker_node(self, node: Any) -> None:
        """Kill every process of the node at once (no graceful shutdown), as a lost machine."""
        self.workers.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def node_ids(self) -> dict[int, str]:
        """raylet pid → the node id it runs."""
        out = {}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = proc.info["cmdline"] or []
            if cmd and cmd[0].endswith("/raylet") and any(self.temp_dir in a for a in cmd):
                node = next(a.split("=", 1)[1] for a in cmd if a.startswith("--node_id="))
                out[proc.info["pid"]] = node
        return out

    def processes(self, title: str) -> dict[int, str]:
        """pid → node id of this cluster's worker processes whose title starts with `title`
        (e.g. "ray::ServeController", "ray::ServeReplica:app:Worker")."""
        raylets = self.node_ids()
        out = {}
        for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
            cmd = proc.info["cmdline"] or []
            if cmd and cmd[0].startswith(title) and proc.info["ppid"] in raylets:
                out[proc.info["pid"]] = raylets[proc.info["ppid"]]
        return out


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@contextmanager
def local_cluster(
    worker_nodes: int = 2, head_cpus: int = 1, worker_cpus: int = 1, namespace: str = "test"
) -> Iterator[LocalCluster]:
    """Head + `worker_nodes` nodes on loopback, this process connected as the driver."""
    saved = {k: os.environ.get(k) for k in (*RAY_ENV, "RAY_TMPDIR")}
    temp_dir = tempfile.mkdtemp(prefix="swanodes-", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    os.environ.update({**RAY_ENV, "RAY_TMPDIR": temp_dir})
    ray_private.set_clusters_enabled(False)  # loopback addresses stay loopback
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "temp_dir": temp_dir, "include_dashboard": False, **_NODE},
        shutdown_at_exit=False,
    )
    local = LocalCluster(cluster, temp_dir)
    try:
        for _ in range(worker_nodes):
            local.add_worker_node(worker_cpus)
        # The driver connects without the workers' logs (`Cluster.connect` streams them all).
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        yield local
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray_private.set_clusters_enabled(True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for _ in range(50):  # helpers exit a moment after their raylet
            shutil.rmtree(temp_dir, ignore_errors=True)
            if not os.path.exists(temp_dir):
                break
            time.sleep(0.1)  # waits on Ray's helper processes leaving the temp dir

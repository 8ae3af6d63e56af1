"""Serve autoscaling of the workers, exercised on the local cluster with small delays: load rises
and Workers go 1 → 2, the new replica's index entry appears and the router places requests on
it; load falls and the extra replica drains (its requests in flight finish) and leaves the index.
No request is lost or cut in either direction; the times are measured and printed."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import ray
from ray import serve

from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray
from cluster.transport import INDEX_NAMESPACE, index_actor_name, kill_index_actor
from deploy.config import APP_IMPORT_PATH, WORKER_DEPLOYMENT, ServeConfig
from tests import serve_internals
from tests.deploy.chaos_load import Load, counts
from tests.deploy.serve_args import serve_args

pytestmark = [
    pytest.mark.ray,
    pytest.mark.loaded,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    # Serve compares look_back_period_s with the deprecated metrics_interval_s (10 s); the push
    # intervals that replaced it are the environment switches below.
    pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning"),
]

APP = "scaling"
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 2,
}


@dataclass
class Served:
    url: str

    def indexed(self) -> set[str]:
        """The workers in the index actor (empty before the first one registered)."""
        try:
            actor = ray.get_actor(index_actor_name(APP, WORKER_DEPLOYMENT), namespace=INDEX_NAMESPACE)
        except ValueError:
            return set()
        return set(ray.get(actor.describe.remote(), timeout=10)["workers"])

    def running(self) -> int:
        app = serve.status().applications[APP]
        states = app.deployments[WORKER_DEPLOYMENT].replica_states
        return sum(n for state, n in states.items() if str(state).endswith("RUNNING"))


# Serve averages ongoing requests over `look_back_period_s` (30 s) of samples pushed every 10 s;
# the test shortens both (a config file's Worker entry, as on KubeRay, and Serve's push-interval
# environment switches) so that scaling follows the load within seconds.
LOOK_BACK_S = 3.0
PUSH_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    saved = {k: os.environ.get(k) for k in PUSH_ENV}
    os.environ.update(PUSH_ENV)
    cluster = start_local_ray(LocalRayConfig(num_cpus=2))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = ServeConfig(model="tiny", autoscaling=SCALING, worker_num_cpus=0.8)
        worker = {"name": WORKER_DEPLOYMENT, **cfg.worker_deployment_options()}
        worker["autoscaling_config"] = {**SCALING, "look_back_period_s": LOOK_BACK_S}
        app = {"name": APP, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": serve_args(cfg),
               "deployments": [worker]}  # fmt: skip
        http = {"host": "127.0.0.1", "port": port}
        serve_internals.deploy_config_file({"http_options": http, "proxy_location": "HeadOnly", "applications": [app]})
        _wait(lambda: str(getattr(serve.status().applications.get(APP), "status", "")).endswith("RUNNING"),
              300, "the application running")  # fmt: skip
        yield Served(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        kill_index_actor(index_actor_name(APP, WORKER_DEPLOYMENT))
        stop_local_ray(cluster)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_workers_scale_up_under_load_and_drain_when_it_falls(served: Served) -> None:
    """1 → 2 under load (the new replica indexed and placed on), 2 → 1 after, nothing lost."""
    _wait(lambda: len(served.indexed()) == 1, 120, "one indexed worker")
    (first,) = served.indexed()
    heavy = Load(served.url, streams=4, plains=4, max_tokens=48).start()
    t_load = time.monotonic()
    try:
        _wait(lambda: len(served.indexed()) == 2, 120, "a second indexed worker")
        t_indexed = time.monotonic() - t_load
        (new,) = served.indexed() - {first}
        _wait(lambda: any(r.replica == new and r.outcome for r in heavy.records), 60, "a request on it")
        placed = min(r.sent for r in heavy.records if r.replica == new) - t_load
    finally:
        up = heavy.stop()
    light = Load(served.url, streams=1, plains=0, max_tokens=96).start()
    t_fall = time.monotonic()
    try:
        _wait(lambda: served.running() == 1, 120, "the extra replica stopped")
        t_one = time.monotonic() - t_fall
        _wait(lambda: len(served.indexed()) == 1, 60, "its index entry removed")
        t_gone = time.monotonic() - t_fall
        n = len(light.records)
        _wait(lambda: counts(light.records[n:])["completed"] >= 2, 60, "answers after the drain")
    finally:
        down = light.stop()
    print(f"\nscale-up: second worker indexed after {t_indexed:.1f}s of load, first request placed "
          f"on it after {placed:.1f}s; scale-down: one replica {t_one:.1f}s after the load fell, "
          f"index entry removed after {t_gone:.1f}s; requests {counts(up)} then {counts(down)}")  # fmt: skip
    for records in (up, down):
        c = counts(records)
        assert c["completed"] == len(records), c
    assert placed < t_indexed + 30


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.25)  # waits on `cond`

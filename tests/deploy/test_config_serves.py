"""The configs really run: `deploy.app:build_app` resolves, and local.yaml serves over HTTP.

Needs `deploy/app.py`. The serving test starts one loopback Ray cluster (2 CPUs, no
dashboard, auth off, a small object store) and deploys local.yaml through the same controller
path as `serve run FILE` and KubeRay (`deploy_apps` of a `ServeDeploySchema`), through Serve's
HTTP proxy as on a cluster. The port changes, so that it does not collide with other runs, and
the app gets an API key, a metrics key and two ingress replicas (what a cluster would set).
"""

from __future__ import annotations

import importlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.config import (
    API_KEY_ENV,
    APP_IMPORT_PATH,
    APP_NAME,
    INGRESS_DEPLOYMENT,
    WORKER_DEPLOYMENT,
    ServeConfig,
)
from deploy.serve_file import load_serve_config
from tests import serve_internals
from tests.deploy.serve_args import serve_args
from tests.deploy.serve_wait import wait_running

pytestmark = pytest.mark.ray

CONFIG_DIR = Path(__file__).resolve().parents[2] / "deploy" / "configs"
LOCAL = CONFIG_DIR / "local.yaml"


def _builder() -> Any:
    module, attr = APP_IMPORT_PATH.split(":")
    return getattr(importlib.import_module(module), attr)


def _built(cfg: ServeConfig) -> dict[str, Any]:
    app = _builder()(serve_args(cfg))
    return {d.name: d for d in serve_internals.build_app(app, name=APP_NAME).deployments}


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_import_path_resolves(path: Path) -> None:
    """Every config's import_path names a callable builder."""
    doc = yaml.safe_load(path.read_text())
    assert {a["import_path"] for a in doc["applications"]} == {APP_IMPORT_PATH}
    assert callable(_builder())


def test_builder_applies_the_worker_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_app(args) has the Ingress and Worker deployments; the Worker options come from args."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = load_serve_config(LOCAL)
    deployments = _built(cfg)
    assert {INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT} <= set(deployments)
    worker = deployments[WORKER_DEPLOYMENT]
    expected = cfg.worker_deployment_options()
    assert worker.max_ongoing_requests == expected["max_ongoing_requests"]
    assert worker.max_queued_requests == expected["max_queued_requests"]
    assert worker.ray_actor_options["num_cpus"] == cfg.worker_num_cpus
    assert worker.ray_actor_options.get("num_gpus", 0) == cfg.worker_num_gpus
    scaling = serve_internals.deployment_config(worker).autoscaling_config
    for key, value in expected["autoscaling_config"].items():
        assert getattr(scaling, key) == value, key


def test_builder_with_fixed_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autoscaling the Worker deployment has exactly `workers` replicas."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    worker = _built(ServeConfig(workers=2, worker_num_cpus=0.25))[WORKER_DEPLOYMENT]
    assert worker.num_replicas == 2
    assert serve_internals.deployment_config(worker).autoscaling_config is None


def test_builder_hands_the_engine_process_options_to_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deploy.replica.deployment import WorkerOptions

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert ServeConfig().engine_niceness == -5
    worker = _built(ServeConfig(engine_niceness=3))[WORKER_DEPLOYMENT]
    options = worker.init_args[1]
    assert options == WorkerOptions(engine_process=True, engine_niceness=3)


# -- local.yaml really serves --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_KEY, METRICS_KEY = "test-key", "scrape-key"


def _http(
    method: str, url: str, body: dict | None = None, timeout: float = 60.0, key: str | None = API_KEY
) -> tuple[int, dict, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return (
                resp.status,
                dict(resp.headers),
                (json.loads(raw) if raw.strip().startswith(b"{") else raw),
            )
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _wait_for_routes(base: str, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            status, _, body = _http("GET", f"{base}/-/routes", timeout=5)
            if status == 200 and body:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)  # waits on Serve publishing the routes
    raise TimeoutError(f"no Serve routes at {base} after {deadline_s} s")


@pytest.fixture(scope="module")
def served_local() -> Iterator[tuple[str, ServeConfig]]:
    import os

    from ray import serve

    from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray

    os.environ.pop(API_KEY_ENV, None)
    port = _free_port()
    doc = yaml.safe_load(LOCAL.read_text())
    doc["http_options"]["port"] = port
    keys = {"api_key": API_KEY, "metrics_key": METRICS_KEY, "ingress_replicas": 2}
    doc["applications"][0]["args"].update(keys)
    cluster = start_local_ray(LocalRayConfig(num_cpus=2))
    try:
        serve_internals.deploy_config_file(doc)
        base = f"http://127.0.0.1:{port}"
        wait_running(APP_NAME, 300)
        _wait_for_routes(base)
        yield base, load_serve_config(LOCAL).model_copy(update=keys)
    finally:
        serve.shutdown()
        stop_local_ray(cluster)


def test_local_config_serves_models_and_completions(served_local) -> None:
    """local.yaml deployed like `serve run`: /v1/models lists the model, a completion returns text."""
    base, _ = served_local
    status, _, models = _http("GET", f"{base}/v1/models")
    assert status == 200 and models["data"], models
    model_id = models["data"][0]["id"]
    status, headers, out = _http(
        "POST", f"{base}/v1/completions",
        {"model": model_id, "prompt": "hello world", "max_tokens": 8, "temperature": 0},
    )  # fmt: skip
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert 0 < out["usage"]["completion_tokens"] <= 8
    assert any(k.lower() == "x-swaserve-replica" for k in headers)


def test_local_config_runs_the_configured_worker(served_local) -> None:
    """The running Worker deployment is healthy with min_replicas replicas and the file's scaling."""
    from ray import serve

    _, cfg = served_local
    app = serve.status().applications[APP_NAME]
    worker = app.deployments[WORKER_DEPLOYMENT]
    assert str(app.status).endswith("RUNNING") and str(worker.status).endswith("HEALTHY")
    running = sum(n for state, n in worker.replica_states.items() if str(state).endswith("RUNNING"))
    assert cfg.autoscaling.min_replicas <= running <= cfg.autoscaling.max_replicas


def test_every_route_but_health_needs_the_key_through_the_proxy(served_local) -> None:
    """Through Serve's proxy: without the key every route answers 401 (/metrics, /docs,
    /tokenize, /v1/models included); /health answers anyone; the metrics key opens /metrics
    alone; answers carry x-request-id, the client's own when it sent one."""
    base, _ = served_local
    routes = [("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}), ("GET", "/docs", None),
              ("GET", "/openapi.json", None), ("GET", "/metrics", None),
              ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})]  # fmt: skip
    for method, path, body in routes:
        assert _http(method, f"{base}{path}", body, key=None)[0] == 401, path
        assert _http(method, f"{base}{path}", body, key=METRICS_KEY)[0] == (200 if path == "/metrics" else 401), path
        assert _http(method, f"{base}{path}", body)[0] == 200, path
    assert _http("GET", f"{base}/health", key=None)[0] == 200
    req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}", "x-request-id": "mine-1"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["x-request-id"] == "mine-1"


def test_two_ingress_replicas_serve_behind_the_proxy(served_local) -> None:
    """ingress_replicas: 2 runs two Ingress replicas; requests through the proxy are answered
    while both run (the proxy spreads them; each replica admits on its own)."""
    from ray import serve

    base, cfg = served_local
    ingress = serve.status().applications[APP_NAME].deployments[INGRESS_DEPLOYMENT]
    running = sum(n for state, n in ingress.replica_states.items() if str(state).endswith("RUNNING"))
    assert cfg.ingress_replicas == running == 2
    for i in range(6):
        status, _, out = _http("POST", f"{base}/v1/completions", {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2})
        assert status == 200, out

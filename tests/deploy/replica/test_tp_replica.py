"""A tensor-parallel worker replica on a loopback Ray cluster: deploy/configs/local-tp.yaml (the
tiny model over 2 ranks, fractional-CPU bundles) serves HTTP, and a killed rank actor fails the
replica cleanly until Serve has replaced it."""

from __future__ import annotations

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

from deploy.config import API_KEY_ENV, APP_NAME, WORKER_DEPLOYMENT
from tests import serve_internals
from tests.deploy.serve_wait import wait_running

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "configs" / "local-tp.yaml"
PROMPT = [5, 17, 99, 310, 42, 7, 256, 11, 600, 3, 88, 140]  # token ids of the tiny vocab
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 90.0  # the first request after a kill: longer is a hang
REPLACEMENT_TIMEOUT_S = 300.0  # Serve queues later ones until the replacement runs (busy machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _complete(base: str, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return _post(f"{base}/v1/completions", body, timeout_s)


def _rank_actors() -> list[tuple[str, str]]:
    """(name, namespace) of every live rank actor."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted((a["name"], a["namespace"]) for a in named if a["name"].startswith("swaserve-tp-"))


def _wait(what: str, ok: Any, timeout_s: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(0.5)  # waits on the condition `ok` polls
    raise TimeoutError(f"{what} after {timeout_s:.0f}s")


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    import os

    from ray import serve

    from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray

    os.environ.pop(API_KEY_ENV, None)
    port = _free_port()
    doc = yaml.safe_load(CONFIG.read_text())
    doc["http_options"]["port"] = port
    cluster = start_local_ray(LocalRayConfig(num_cpus=2))
    try:
        serve_internals.deploy_config_file(doc)
        wait_running(APP_NAME, 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        stop_local_ray(cluster)


@pytest.fixture(scope="module")
def expected_text() -> str:
    """What one rank computes for the prompt (the engine in this process, TP = 1)."""
    from worker import Engine, EngineConfig, SamplingParams
    from worker.models.model_dir import load_tokenizer

    cfg = EngineConfig(model="tiny", page_size=16, max_total_tokens=4096, swa_full_tokens_ratio=0.5)
    engine = Engine(cfg)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert engine.parts.model_dir is not None
    return str(load_tokenizer(engine.parts.model_dir).decode(out.token_ids, skip_special_tokens=True))


def test_a_tp2_replica_serves_completions_over_http(served: str, expected_text: str) -> None:
    """The replica (rank 0) and one rank actor in its placement group answer like one rank."""
    ((rank1, _),) = _rank_actors()
    assert rank1.endswith("-rank1")
    status, out = _complete(served)
    assert status == 200, out
    assert out["choices"][0]["text"] == expected_text


def test_a_killed_rank_fails_the_replica_cleanly_and_serve_replaces_it(
    served: str, expected_text: str
) -> None:
    """ray.kill(rank 1): requests fail fast (never hang), the health check fails, Serve starts
    a new replica with a new rank actor, and it serves the same tokens."""
    import ray
    from ray import serve

    ((old, namespace),) = _rank_actors()
    actor = ray.get_actor(old, namespace=namespace)
    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.__ray_ready__.remote(), timeout=30)

    # The first request meets the broken replica: it must fail at once, not hang (the timeout
    # raises). Later ones may wait in Serve's queue until the replacement replica runs.
    status, out = _complete(served)
    assert status in (500, 503), ("the first request after the kill was not refused", status, out)
    statuses = [status]
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while status != 200:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no replacement replica after {REPLACEMENT_TIMEOUT_S:.0f} s: {statuses}"
        time.sleep(0.5)  # paces the retries while Serve replaces the replica
        status, out = _complete(served, max(remaining, 1.0))
        statuses.append(status)
        assert status in (200, 500, 503), (status, out)
    assert out["choices"][0]["text"] == expected_text
    ((new, _),) = _wait("a new rank actor", lambda: [a for a in _rank_actors() if a[0] != old])
    assert new.endswith("-rank1")
    worker = serve.status().applications[APP_NAME].deployments[WORKER_DEPLOYMENT]
    assert str(worker.status).endswith("HEALTHY")

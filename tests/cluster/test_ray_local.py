"""`cluster.ray_local`'s per-cluster environment, without starting Ray."""

from __future__ import annotations

import pytest

from cluster import ray_local


def test_direct_ingress_switches_are_restored_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a cluster with `direct_ingress_port` sets is undone at stop: a variable the user
    had keeps its value, one that was unset is removed again."""
    env = ray_local.direct_ingress_env(8123)
    monkeypatch.setenv("RAY_SERVE_PORT_QUARANTINE_S", "7")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    ray_local._set_env(env)
    assert {k: ray_local.os.environ[k] for k in env} == env
    ray_local._set_env(ray_local.direct_ingress_env(9000))  # a second set keeps the first saved
    ray_local._restore_env()
    assert ray_local.os.environ["RAY_SERVE_PORT_QUARANTINE_S"] == "7"
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in ray_local.os.environ
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in ray_local.os.environ or (
        ray_local.os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] not in ("8123", "9000")
    )

"""Waiting on Serve from a test: conditions with deadlines, never a fixed sleep."""

from __future__ import annotations

import time


def wait_running(app_name: str, deadline_s: float) -> None:
    """Until `serve.status()` reports the application RUNNING (every deployment's replicas up)."""
    from ray import serve

    end = time.monotonic() + deadline_s
    while not str(getattr(serve.status().applications.get(app_name), "status", "")).endswith("RUNNING"):
        assert time.monotonic() < end, f"{app_name} not RUNNING after {deadline_s} s: {serve.status()}"
        time.sleep(0.5)  # waits on Serve starting the application's replicas

"""Streaming helpers of the ingress: SSE framing, request timing metrics, worker error mapping."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel

from cluster.messages import WorkerUnavailableError
from deploy.metrics import IngressMetrics
from deploy.openai.schema import APIError, overloaded
from deploy.replica.client import engine_died

ENGINE_DIED = "the engine serving this request stopped while running it; retry later"
SSE_DONE = "data: [DONE]\n\n"  # a completion or chat stream's last event


class RequestTimer:
    """TTFT, inter-token latency and end-to-end latency of one HTTP request."""

    def __init__(self, metrics: IngressMetrics, endpoint: str, t0: float) -> None:
        self._m, self._endpoint, self._t0 = metrics, endpoint, t0
        self._itl = metrics.itl.labels(endpoint)  # looked up once: `tokens` runs per delta
        self._last: float | None = None
        self._closed = False

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.labels(self._endpoint).observe(now - self._t0)
        else:
            gap = (now - self._last) / n  # a coalesced delta carries n tokens
            for _ in range(n):
                self._itl.observe(gap)
        self._last = now

    def done(self) -> None:
        if not self._closed:
            self._closed = True
            self._m.latency.labels(self._endpoint).observe(time.monotonic() - self._t0)


def translate_worker_error(e: BaseException, retry_after_s: int) -> APIError:
    """Map what a worker call can raise to an HTTP status (overload/unavailable -> 503)."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(e, BackPressureError):
        # Serve's backpressure_config may ask for 429 and its own Retry-After; honour both.
        status = 429 if getattr(e, "status_code", 503) == 429 else 503
        retry = getattr(e, "retry_after_s", None)
        return overloaded(status, "worker queues are full; retry later", int(retry) if retry else retry_after_s)
    if engine_died(e):  # the engine (or its replica) died running it: before any worker text
        return overloaded(503, ENGINE_DIED, retry_after_s)
    if isinstance(e, WorkerUnavailableError):
        return overloaded(503, str(e), retry_after_s)
    if isinstance(e, DeploymentUnavailableError):
        return overloaded(503, "no worker replica is available; retry later", retry_after_s)
    name = type(e).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "ReplicaUnavailable" in name:
        return overloaded(503, f"a worker replica went away ({name}); retry", retry_after_s)
    # The exception's text (a Ray traceback, a path) is for the log: `errors.public` puts it
    # there under the request id, which is all the client gets of it.
    return APIError(500, "internal error while generating", type="server_error")


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def from_model(m: BaseModel) -> str:
    return f"data: {m.model_dump_json(exclude_none=True)}\n\n"

"""Builds the ingress app over in-process worker deployments with fake engines (no Ray)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deploy.openai.admission import AdmissionLimits
from deploy.openai.ingress import IngressOptions, create_app
from deploy.openai.limits import RequestLimits
from deploy.openai.service import OpenAIService, ServiceOptions
from deploy.replica.deployment import WorkerDeployment
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.inprocess import InProcessWorkerClient
from worker.config import EngineConfig

MODEL = "tiny-fake"
MAX_MODEL_LEN = 96


@dataclass
class Harness:
    app: Any
    service: OpenAIService
    workers: list[WorkerDeployment]
    engines: list[FakeEngine]
    tokenizer: Any

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://ingress", **kwargs)


def make_harness(
    tokenizer: Any,
    *,
    workers: int = 1,
    admission: AdmissionLimits | None = None,
    api_key: str | None = None,
    metrics_key: str | None = None,
    metrics_auth: bool = True,
    max_request_bytes: int = 64 * 1024,
    step_s: float = 0.001,
    script: list[int] | None = None,
    chat_format: Any = None,
    max_model_len: int = MAX_MODEL_LEN,
    limits: RequestLimits | None = None,
    request_timeout_s: float | None = None,
    write_timeout_s: float = 30.0,
    engine: type[FakeEngine] = FakeEngine,
) -> Harness:
    engines: list[FakeEngine] = []

    def factory(cfg: EngineConfig) -> FakeEngine:
        engines.append(engine(cfg, vocab_size=len(tokenizer), step_s=step_s, model_dir=Path("."), script=script))
        return engines[-1]

    cfg = EngineConfig(page_size=4, max_model_len=max_model_len)
    deployments = [WorkerDeployment(cfg, engine_factory=factory, replica_id=f"w{i}") for i in range(workers)]
    options = ServiceOptions(model_name=MODEL, admission=admission or AdmissionLimits(sequences=64),
                             limits=limits or RequestLimits(), request_timeout_s=request_timeout_s)  # fmt: skip
    service = OpenAIService(tokenizer, InProcessWorkerClient(deployments), options, chat_format=chat_format)
    ingress = IngressOptions(service=options, api_key=api_key, max_request_bytes=max_request_bytes,
                             metrics_key=metrics_key, metrics_auth=metrics_auth, write_timeout_s=write_timeout_s)  # fmt: skip
    app = create_app(service, ingress)
    return Harness(app, service, deployments, engines, tokenizer)


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body into JSON objects; the final `[DONE]` becomes the string "[DONE]"."""
    import json

    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def expected_greedy(prompt_ids: list[int], n: int, vocab: int) -> list[int]:
    """The fake engine's greedy continuation."""
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = (last * 31 + 7) % vocab
        out.append(last)
    return out

"""How the host tier is reported (docs/design.md §9.9, §13): the loaded-token headers beside the
repaired ones, the ingress's load counters, and each replica's host-tier gauges and counters."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.outputs import EngineStats, PoolStats, StreamDelta
from deploy.metrics import IngressMetrics, flatten_stats
from deploy.openai.headers import prediction_headers, served_headers
from router import routing_record
from tests.deploy.openai.openai_harness import MODEL, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_headers_per_choice() -> None:
    """Predictions per prompt (empty where no router placed it), what each choice really had."""
    placed = routing_record.Placement("w0", "swa_prefix", 64, 0, 40)
    assert prediction_headers([placed, None]) == {
        "x-swaserve-predicted-cached-tokens": "64,",
        "x-swaserve-predicted-repaired-tokens": "0,",
        "x-swaserve-predicted-loaded-tokens": "40,",
    }
    assert served_headers([0, 128], [40, 0]) == {
        "x-swaserve-repaired-tokens": "0,128", "x-swaserve-loaded-tokens": "40,0",
    }  # fmt: skip


def test_replica_gauges_and_counters_of_the_host_tier() -> None:
    """Each replica's host tier: size and use per kind, tokens loaded / offloaded, bytes loaded."""
    stats = EngineStats(
        full=PoolStats(100, 50, 0, 50, 60), swa=PoolStats(40, 20, 0, 20, 30), hybrid=True,
        waiting=0, running=0, queued_prefill_tokens=0, running_decodes=0, cache_hit_tokens=0,
        prompt_tokens=0, generated_tokens=0, full_evicted_tokens=0, swa_evicted_tokens=0,
        tombstone_tokens=0, retractions=0, aborts=0, steps=0, last_step_seconds=0.0,
        host_full=PoolStats(400, 0, 0, 300, 0), host_swa=PoolStats(160, 0, 0, 64, 0),
        loaded_tokens=96, loaded_bytes=96 * 2048, offloaded_tokens=512,
    )  # fmt: skip
    families = _families(IngressMetrics().render({"w0": flatten_stats(stats), "w1": None}).decode())
    host = {(s.name, s.labels["kind"]): s.value for f in ("swaserve_host_kv_total_tokens", "swaserve_host_kv_used_tokens")
            for s in families[f].samples}  # fmt: skip
    assert host == {
        ("swaserve_host_kv_total_tokens", "full"): 400, ("swaserve_host_kv_total_tokens", "swa"): 160,
        ("swaserve_host_kv_used_tokens", "full"): 300, ("swaserve_host_kv_used_tokens", "swa"): 64,
    }  # fmt: skip
    counters = {f: families[f"swaserve_engine_{f}"].samples[0].value for f in ("loaded_tokens", "loaded_bytes", "offloaded_tokens")}
    assert counters == {"loaded_tokens": 96, "loaded_bytes": 96 * 2048, "offloaded_tokens": 512}


def test_a_loaded_prefix_reaches_the_headers_and_the_counters(tokenizer: Any) -> None:
    """A worker that loaded 24 KV tokens of the prompt: the non-streamed response says so beside
    the router's prediction, and the ingress counts one load of 24 tokens."""
    h = make_harness(tokenizer)
    engine, client = h.engines[0], h.service._client
    generate, stream = engine.generate, client.stream

    async def loading(*args: Any, **kw: Any) -> AsyncGenerator[StreamDelta, None]:
        async for delta in generate(*args, **kw):
            yield dataclasses.replace(delta, loaded_tokens=24)

    def routed(request: Any, deaths: Any = None) -> Any:
        routing_record.note_placed(request.request_id, routing_record.Placement("w0", "swa_prefix", 0, 0, 24))
        return stream(request, deaths)

    engine.generate = loading  # type: ignore[method-assign]
    client.stream = routed

    async def go() -> tuple[Any, str]:
        async with h.client() as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
            return r, (await c.get("/metrics")).text

    r, metrics = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert r.headers["x-swaserve-loaded-tokens"] == "24" and r.headers["x-swaserve-predicted-loaded-tokens"] == "24"
    families = _families(metrics)
    assert families["swaserve_loaded_prompt_tokens"].samples[0].value == 24
    assert families["swaserve_host_loads"].samples[0].value == 1

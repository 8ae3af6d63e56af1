"""The OpenAI API in-process: FastAPI app + OpenAIService + WorkerDeployment + fake engine (no Ray)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.config import API_KEY_FILE_ENV
from deploy.openai.admission import AdmissionLimits
from deploy.openai.ingress import IngressOptions, with_key_file
from deploy.openai.service import ServiceOptions
from tests.deploy.openai.bad_inputs import bad_inputs, check_error
from tests.deploy.openai.openai_harness import (
    MAX_MODEL_LEN,
    MODEL,
    expected_greedy,
    make_harness,
    sse_events,
)
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_completion_greedy_matches_engine(tokenizer: Any) -> None:
    """A greedy completion of token ids returns exactly the engine's tokens, decoded."""
    h = make_harness(tokenizer)
    prompt = [11, 22, 33]

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})

    r = run(go())
    assert r.status_code == 200, r.text
    body = r.json()
    want = expected_greedy(prompt, 6, len(tokenizer))
    assert body["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert r.headers["x-swaserve-replica"] == "w0"


def test_streaming_equals_non_streaming_with_usage(tokenizer: Any) -> None:
    """SSE chunks concatenate to the non-streamed text; include_usage adds a final usage chunk."""
    h = make_harness(tokenizer)
    req = {"model": MODEL, "prompt": "Hello world", "max_tokens": 12, "temperature": 0}

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            plain = await c.post("/v1/completions", json=req)
            streamed = await c.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
            return plain, streamed

    plain, streamed = run(go())
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == plain.json()["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_uses_template_and_streams_role_first(tokenizer: Any) -> None:
    """Chat renders the chat template (prompt tokens = template tokens) and streams a role delta first."""
    h = make_harness(tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want_prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want_len = len(tokenizer(want_prompt, add_special_tokens=False)["input_ids"])

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            req = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0}
            return await c.post("/v1/chat/completions", json=req), await c.post(
                "/v1/chat/completions", json={**req, "stream": True})

    plain, streamed = run(go())
    body = plain.json()
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == want_len
    assert body["choices"][0]["message"]["role"] == "assistant"
    events = sse_events(streamed.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == body["choices"][0]["message"]["content"]


def test_chat_default_max_tokens_fills_context(tokenizer: Any) -> None:
    """Chat without max_tokens generates until the context is full (finish_reason length)."""
    h = make_harness(tokenizer)

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})

    body = run(go()).json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_and_aborts(tokenizer: Any) -> None:
    """A stop string ends the choice: text stops before it, finish_reason is stop, KV is freed."""
    h = make_harness(tokenizer)
    prompt = [11, 22, 33]
    full = tokenizer.decode(expected_greedy(prompt, 40, len(tokenizer)), skip_special_tokens=True)
    stop = full[10:13]
    assert stop and stop not in full[:10]

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 40,
                                                         "temperature": 0, "stop": stop})  # fmt: skip

    body = run(go()).json()
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert h.engines[0].stats().full.used == 0


def test_n_and_batch_prompts_fan_out(tokenizer: Any) -> None:
    """n=2 over two prompts gives four indexed choices; prompt tokens are counted once per prompt."""
    h = make_harness(tokenizer, workers=2)

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "n": 2,
                                                         "max_tokens": 3, "temperature": 0})  # fmt: skip

    r = run(go())
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    assert set(r.headers["x-swaserve-replica"].split(",")) == {"w0", "w1"}


def test_logprobs_both_shapes(tokenizer: Any) -> None:
    """Completions return tokens/token_logprobs/top_logprobs; chat returns content entries with bytes."""
    h = make_harness(tokenizer)

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            a = await c.post("/v1/completions", json={"model": MODEL, "prompt": [7, 8], "max_tokens": 3, "logprobs": 2})
            b = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "q"}],
                                                           "max_tokens": 3, "logprobs": True, "top_logprobs": 1})  # fmt: skip
            return a.json(), b.json()

    a, b = run(go())
    lp = a["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"] == [-0.5] * 3
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    content = b["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 1
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_repeated_prompt_reports_cached_tokens(tokenizer: Any) -> None:
    """The second identical long prompt reports usage.prompt_tokens_details.cached_tokens > 0."""
    h = make_harness(tokenizer)
    req = {"model": MODEL, "prompt": list(range(1, 41)), "max_tokens": 2}

    async def go() -> list[Any]:
        async with h.client() as c:
            return [(await c.post("/v1/completions", json=req)).json() for _ in range(2)]

    first, second = run(go())
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bad_inputs_table_then_still_serving(tokenizer: Any) -> None:
    """Every bad input gets its documented status and OpenAI error body; a good request works after."""
    h = make_harness(tokenizer)
    cases = [c for c in bad_inputs(MODEL, MAX_MODEL_LEN) if not c.real_engine]
    assert len(cases) >= 15

    async def go() -> Any:
        async with h.client() as c:
            for case in cases:
                r = await c.request(case.method, case.path, content=case.body,
                                    headers={"content-type": "application/json"})  # fmt: skip
                check_error(r.status_code, r.json(), case)
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})

    assert run(go()).status_code == 200
    assert h.service.inflight == 0
    assert h.engines[0].stats().full.used == 0


def test_api_key_from_the_key_file(
    tokenizer: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no key in the options, the ingress takes the one in SWASERVE_API_KEY_FILE (the Helm
    chart's way) and /v1/* needs it; a key in the options wins over the file."""
    (tmp_path / "api-key").write_text("from-file\n")
    monkeypatch.setenv(API_KEY_FILE_ENV, str(tmp_path / "api-key"))
    service = ServiceOptions(model_name=MODEL)
    explicit = IngressOptions(service=service, api_key="from-config")
    assert with_key_file(explicit).api_key == "from-config"
    h = make_harness(tokenizer, api_key=with_key_file(IngressOptions(service=service)).api_key)
    req = {"model": MODEL, "prompt": "hi", "max_tokens": 1}

    async def go() -> list[Any]:
        async with h.client() as c:
            return [
                await c.post("/v1/completions", json=req),
                await c.post("/v1/completions", json=req, headers={"Authorization": "Bearer from-file"}),
            ]

    none, right = run(go())
    assert none.status_code == 401 and right.status_code == 200


def test_body_limit_413_by_header_and_by_bytes(tokenizer: Any) -> None:
    """Bodies over max_request_bytes get 413, whether Content-Length says so or the stream does."""
    h = make_harness(tokenizer, max_request_bytes=2048)
    big = json.dumps({"model": MODEL, "prompt": "x" * 4000}).encode()

    async def chunks() -> Any:
        for i in range(0, len(big), 512):
            yield big[i : i + 512]

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            return await c.post("/v1/completions", content=big), await c.post("/v1/completions", content=chunks())

    by_header, by_stream = run(go())
    assert by_header.status_code == by_stream.status_code == 413
    assert by_stream.json()["error"]["code"] == "request_too_large"


def test_overload_429_with_retry_after(tokenizer: Any) -> None:
    """Past max_inflight_sequences the ingress answers 429 with Retry-After at once, and recovers after."""
    h = make_harness(tokenizer, admission=AdmissionLimits(sequences=1), step_s=0.01)
    raw = json.dumps({"model": MODEL, "prompt": "hold", "max_tokens": 5, "stream": True}).encode()

    async def go() -> tuple[Any, Any, Any]:
        held = await h.service.completions(raw)  # holds the only slot until its events are read
        async with h.client() as c:
            busy = await asyncio.wait_for(c.post("/v1/completions", content=raw), 5)
            _ = [e async for e in held.events]  # type: ignore[union-attr]
            after = await c.post("/v1/completions", content=raw)
        return busy, after, held

    busy, after, _ = run(go())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert after.status_code == 200


def test_abandoned_stream_frees_kv(tokenizer: Any) -> None:
    """Closing a stream mid-way aborts the worker request: the engine holds no KV afterwards."""
    h = make_harness(tokenizer, step_s=0.005)
    raw = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 80, "stream": True}).encode()

    async def go() -> tuple[int, int]:
        reply = await h.service.completions(raw)
        events = reply.events
        assert events is not None
        for _ in range(3):
            await events.__anext__()
        held = h.engines[0].stats().full.used
        await events.aclose()  # type: ignore[attr-defined]
        return held, h.engines[0].stats().full.used

    held, after = run(go())
    assert held > 0 and after == 0
    assert h.engines[0].stats().aborts == 1 and h.service.inflight == 0


def test_metrics_parse_with_both_pools_per_replica(tokenizer: Any) -> None:
    """/metrics parses with prometheus_client and has full+swa gauges for every replica."""
    h = make_harness(tokenizer, workers=2)

    async def go() -> str:
        async with h.client() as c:
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "warm", "max_tokens": 3, "stream": True})
            return (await c.get("/metrics")).text

    families = {f.name: f for f in text_string_to_metric_families(run(go()))}
    free = {(s.labels["replica"], s.labels["pool"]) for s in families["swaserve_kv_free_tokens"].samples}
    assert free == {("w0", "full"), ("w0", "swa"), ("w1", "full"), ("w1", "swa")}
    assert "swaserve_time_to_first_token_seconds" in families
    assert any(s.value > 0 for s in families["swaserve_inter_token_latency_seconds"].samples
               if s.name.endswith("_count"))  # fmt: skip


def test_models_and_health(tokenizer: Any) -> None:
    """/v1/models lists the served model with its context; /health is 200 when workers answer."""
    h = make_harness(tokenizer)

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            return (await c.get("/v1/models")).json(), await c.get("/health")

    models, health = run(go())
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert health.status_code == 200 and health.json()["workers_ready"] == 1


def test_draining_worker_gives_503_with_retry_after(tokenizer: Any) -> None:
    """A worker that is shutting down refuses; the client gets 503 + Retry-After, not a hang."""
    h = make_harness(tokenizer)
    h.workers[0].shutdown()

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})

    r = run(go())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "service_unavailable" and h.engines[0].shut_down


def test_worker_backpressure_maps_to_503() -> None:
    """Serve's BackPressureError (worker queues full) becomes a 503 with Retry-After."""
    from ray.serve.exceptions import BackPressureError

    from deploy.openai.streaming import translate_worker_error

    err = translate_worker_error(BackPressureError(num_queued_requests=9, max_queued_requests=8), 2)
    assert err.status == 503 and err.headers == {"Retry-After": "2"}
    assert translate_worker_error(RuntimeError("boom"), 1).status == 500


def test_router_prediction_is_echoed_in_header(tokenizer: Any) -> None:
    """The router's prediction for the serving replica comes back as x-swaserve-predicted-cached-tokens."""
    from router import routing_record

    h = make_harness(tokenizer)
    client = h.service._client
    original = client.stream

    def routed(request: Any, deaths: Any = None) -> Any:
        # What the Serve router notes in this process when Serve reports that w0 took it.
        routing_record.note_placed(request.request_id, routing_record.Placement("w0", "swa_prefix", 16, 0))
        return original(request, deaths)

    client.stream = routed

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})

    r = run(go())
    assert r.headers["x-swaserve-predicted-cached-tokens"] == "16"


def test_a_placement_on_another_replica_gives_no_prediction_header(tokenizer: Any) -> None:
    """A placement the routing record holds for a replica other than the one that served (a
    stale one) predicts nothing for the response."""
    from router import routing_record

    h = make_harness(tokenizer)
    client = h.service._client
    original = client.stream

    def routed(request: Any, deaths: Any = None) -> Any:
        routing_record.note_placed(request.request_id, routing_record.Placement("w9", "swa_prefix", 64, 0))
        return original(request, deaths)

    client.stream = routed

    async def go() -> Any:
        async with h.client() as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})

    r = run(go())
    assert r.status_code == 200 and "x-swaserve-predicted-cached-tokens" not in r.headers

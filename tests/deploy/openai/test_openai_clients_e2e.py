"""Real clients against `swaserve serve` (tiny model, 2 workers): the `openai` package for every
row of the OpenAI surface (multi-choice, batches, echo and prompt logprobs, seeds, sampling
controls, structured outputs, tools), lm-evaluation-harness's `local-completions` against its
`hf` model, the exact bodies `vllm bench serve` sends, and schemathesis over `/openapi.json`.
Runs before test_openai_e2e.py on the session's server (conftest.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.openai.conftest import MODEL, Server

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                     "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
MSGS = [{"role": "user", "content": "Hello there!"}]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_multi_choice_and_batches_stream_and_not(server: Server) -> None:
    """n, prompt lists and best_of answer (they used to hang), streamed and not, with indices."""
    c = _client(server)
    comp = c.completions.create(model=MODEL, prompt="Once upon", n=2, max_tokens=5, seed=3)
    batch = c.completions.create(model=MODEL, prompt=[[10, 20, 30], [40, 50]], n=2, max_tokens=3, temperature=0)
    best = c.completions.create(model=MODEL, prompt="Once upon", n=2, best_of=3, max_tokens=4)
    chat = c.chat.completions.create(model=MODEL, messages=MSGS, n=2, max_tokens=5)
    assert [x.index for x in comp.choices] == [0, 1] and [x.index for x in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.usage.prompt_tokens == 5
    assert [x.index for x in best.choices] == [0, 1] and [x.index for x in chat.choices] == [0, 1]
    seen: dict[int, str] = {}
    for chunk in c.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=3, temperature=0, stream=True):
        for ch in chunk.choices:
            seen[ch.index] = seen.get(ch.index, "") + ch.text
    assert sorted(seen) == [0, 1, 2]
    finished = set()
    for chunk in c.chat.completions.create(model=MODEL, messages=MSGS, n=3, max_tokens=3, stream=True):
        finished |= {ch.index for ch in chunk.choices if ch.finish_reason}
    assert finished == {0, 1, 2}


def test_choices_share_one_prefill(server: Server) -> None:
    """n=3 over a long prompt: the choices go to one replica and prompt tokens count once."""
    prompt = [5 + (i * 7) % 900 for i in range(200)]
    raw = _client(server).completions.with_raw_response.create(model=MODEL, prompt=prompt, n=3, max_tokens=2)
    out = raw.parse()
    assert len(out.choices) == 3 and out.usage.prompt_tokens == 200
    assert "," not in raw.headers["x-swaserve-replica"]


def test_echo_logprobs_and_prompt_logprobs_on_a_cache_hit(server: Server) -> None:
    """echo + logprobs with max_tokens 0 and 1 (first logprob null); prompt logprobs of a cached
    prompt equal the uncached ones."""
    c = _client(server)
    prompt = [5 + (i * 11) % 900 for i in range(120)]
    first = c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # now the prompt is cached
    again = c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    a, b = first.choices[0].logprobs, again.choices[0].logprobs
    assert a.token_logprobs[0] is None and len(a.token_logprobs) == 120 and len(b.token_logprobs) == 121
    assert max(abs(x - y) for x, y in zip(a.token_logprobs[1:], b.token_logprobs[1:120])) < 1e-4
    assert first.usage.completion_tokens == 0 and first.choices[0].finish_reason == "length"
    vllm_style = c.completions.with_raw_response.create(model=MODEL, prompt=prompt[:10], max_tokens=1,
                                                        extra_body={"prompt_logprobs": 1})  # fmt: skip
    pl = json.loads(vllm_style.text)["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == 10 and str(prompt[1]) in pl[1]


def test_seeds_of_any_size_and_distinct(server: Server) -> None:
    """Seeds equal in their low 32 or 64 bits give different samples; >= 2**64 is served; a seed
    repeats its text."""
    c = _client(server)
    texts = [c.completions.create(model=MODEL, prompt="Seed", max_tokens=8, seed=s).choices[0].text
             for s in (1, 2**32 + 1, 2**63 + 1, 2**64 + 1)]  # fmt: skip
    assert len(set(texts)) == 4
    assert c.completions.create(model=MODEL, prompt="Seed", max_tokens=8, seed=2**64 + 1).choices[0].text == texts[3]


def test_sampling_controls_on_the_engine(server: Server) -> None:
    """logit_bias forces a token; min_tokens holds a stop token back; penalties, many stop
    strings and skip_special_tokens are accepted (completions and chat)."""
    c = _client(server)
    forced = c.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logit_bias={"300": 100})
    held = c.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0, logit_bias={"300": 100},
                                extra_body={"min_tokens": 3, "stop_token_ids": [300]})  # fmt: skip
    assert forced.usage.completion_tokens == 4 and held.usage.completion_tokens == 4
    assert held.choices[0].finish_reason == "stop"
    extra = {"repetition_penalty": 1.3, "skip_special_tokens": False, "ignore_eos": True, "min_p": 0.05}
    for out in (
        c.completions.create(model=MODEL, prompt="x", max_tokens=6, presence_penalty=1.0, frequency_penalty=0.5,
                             stop=[f"q{i}" for i in range(8)], extra_body=extra),
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, presence_penalty=1.0,
                                  stop=[f"q{i}" for i in range(8)], extra_body=extra),
    ):  # fmt: skip
        assert out.usage.completion_tokens >= 1


def test_json_schema_output_validates_for_20_seeds(server: Server) -> None:
    """response_format json_schema: every one of 20 seeded samples parses and validates."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def go() -> list[str]:
        c = _aclient(server)
        outs = await asyncio.gather(*(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=96, seed=s,
                                      response_format=fmt) for s in range(20)))  # type: ignore[arg-type]  # fmt: skip
        return [o.choices[0].message.content for o in outs]

    for text in asyncio.run(go()):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_spellings_on_the_engine(server: Server) -> None:
    """vLLM's guided_choice and guided_regex hold on the real model."""
    c = _client(server)
    choice = c.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    regex = c.completions.create(model=MODEL, prompt="x", max_tokens=12, extra_body={"guided_regex": "[0-9]{3}-[a-c]"})
    # Seed 39676's first draw is the top 24-bit value (a forbidden token once won there).
    edge = c.completions.create(model=MODEL, prompt="x", max_tokens=12, seed=39676,
                                extra_body={"guided_regex": "[0-9]{3}-[a-c]"})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    for r in (regex, edge):
        assert len(r.choices[0].text) == 5 and r.choices[0].text[3] == "-"


def test_tool_choice_required_and_named(server: Server) -> None:
    """tool_choice required and named yield tool calls whose arguments follow the schema."""
    import jsonschema

    c = _client(server)
    params = WEATHER["function"]["parameters"]  # type: ignore[index]
    named = c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=48,  # type: ignore[list-item]
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=96,  # type: ignore[list-item]
                                         tool_choice="required", parallel_tool_calls=False)
    for out in (named, required):
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=48, stream=True,  # type: ignore[list-item]
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"


def test_utility_routes_and_model_card(server: Server) -> None:
    """/openapi.json, /docs, /tokenize, /detokenize, models.retrieve, and `root` in /v1/models
    (the model id: no path of the server)."""
    c = _client(server)
    assert c.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["root"] == MODEL
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])
    assert httpx.get(f"{server.url}/docs", timeout=30).status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=30).json()
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30).json()
    assert text["prompt"].endswith("Hello world") and tok["max_model_len"] > 0


def test_vllm_bench_serve_request_bodies(server: Server) -> None:
    """The bodies `vllm bench serve --backend openai` / `openai-chat` send (vLLM's
    benchmarks/lib/endpoint_request_func.py), with its x-request-id header (answered with the
    same id), stream to the end."""
    completions = {"model": MODEL, "prompt": "The quick brown fox", "repetition_penalty": 1.0, "max_tokens": 8,
                   "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}],
            "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for path, body in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
            r = http.post(path, json=body, headers={"x-request-id": "bench-1"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "bench-1"  # the client's own id comes back
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["usage"]["completion_tokens"] == 8 and r.text.rstrip().endswith("data: [DONE]")
    assert "root" in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]


def _metrics(server: Server) -> dict[str, Any]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _status_count(server: Server, status: str) -> float:
    fam = _metrics(server)["swaserve_http_requests"]
    return sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels.get("status") == status)


def test_disconnect_before_headers_counts_499(server: Server) -> None:
    """A client that hangs up while a non-streamed request runs is counted as 499, not 500."""
    before, before_500 = _status_count(server, "499"), _status_count(server, "500")
    # Nearly the whole context: still running when the stats report shows it, on any machine.
    max_model_len = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": max_model_len - 64, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    deadline = time.monotonic() + 120
    while not sum(s.value for s in _metrics(server)["swaserve_kv_used_tokens"].samples):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)  # waits on the replica's stats report
    sock.close()
    deadline = time.monotonic() + 120
    while _status_count(server, "499") <= before:
        assert time.monotonic() < deadline, "no 499 counted after the client left"
        time.sleep(0.2)  # waits on Serve noticing the disconnect
    assert _status_count(server, "500") == before_500


def test_schemathesis_finds_no_server_error(server: Server) -> None:
    """Generated requests for both endpoints from /openapi.json: no 5xx, no hang (max_tokens
    capped so the bounded run stays short), and the server still serves afterwards."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    statuses: list[int] = []
    for path in ("/v1/completions", "/v1/chat/completions"):

        @given(case=schema[path]["POST"].as_strategy())
        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])  # fmt: skip
        def check(case: Any) -> None:
            if isinstance(case.body, dict):
                for key in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(key), int) and case.body[key] > 8:
                        case.body[key] = 8
                if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
                    case.body["max_tokens"] = 8
            response = case.call(timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])

        check()
    assert any(s == 200 for s in statuses) and any(s == 400 for s in statuses)
    ok = _client(server).completions.create(model=MODEL, prompt="still there?", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


TASKS = {
    "tiny_ll": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "answer",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "tiny_gen": {"output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
                 "generation_kwargs": {"until": ["\n", ".", "!", "?", ";"], "max_gen_toks": 8, "do_sample": False},
                 "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
}  # fmt: skip
DOCS = [
    {"question": "The cat sat on the", "choices": [" mat", " moon", " idea"], "answer": 0},
    {"question": "One, two, three,", "choices": [" four", " blue", " seven"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " loud"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " square"], "answer": 0},
    {"question": "Hello", "choices": [" world", " there"], "answer": 1},
]


def _task_dir(root: Path) -> Path:
    import yaml

    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, spec in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "doc_to_text": "{{question}}", **spec}  # fmt: skip
        (root / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return root


def test_lm_eval_local_completions_matches_hf(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's local-completions model (batch_size 4: prompt lists, echo + logprobs) on a
    loglikelihood and a generate_until task gives the loglikelihoods of its hf model on the same
    tiny model directory (1e-3) and the same greedy generations."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from worker.models.tiny import ensure_tiny_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir, tasks = str(ensure_tiny_model()), _task_dir(tmp_path)

    def run(model: str, args: str) -> dict[str, Any]:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=list(TASKS), batch_size=4,
                                       log_samples=True, task_manager=TaskManager(include_path=str(tasks)))  # fmt: skip

    served = run("local-completions", f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={model_dir},"
                 "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
    local = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    ours = [r[0] for s in served["samples"]["tiny_ll"] for r in s["filtered_resps"]]
    theirs = [r[0] for s in local["samples"]["tiny_ll"] for r in s["filtered_resps"]]
    assert len(ours) == len(theirs) == 13
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, (ours, theirs)
    gen = [s["filtered_resps"] for s in served["samples"]["tiny_gen"]]
    assert gen == [s["filtered_resps"] for s in local["samples"]["tiny_gen"]]

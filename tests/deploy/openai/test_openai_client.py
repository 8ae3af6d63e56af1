"""The `openai` package against the in-process ingress (fake engines): multi-choice and batched
prompts, echo and prompt logprobs, sampling controls reaching the engine, structured outputs,
tools, the utility routes. The same rows on the real engine: test_openai_surface_e2e.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from core.sampling_params import Grammar
from tests.deploy.openai.openai_harness import MODEL, Harness, expected_greedy, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _client(h: Harness) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://ingress")
    return openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="x", http_client=http, max_retries=0)


def _run(h: Harness, fn: Any) -> Any:
    async def go() -> Any:
        async with _client(h) as c:
            return await fn(c)

    return asyncio.run(go())


async def _texts(stream: Any, chat: bool = False) -> dict[int, str]:
    out: dict[int, str] = {}
    async for chunk in stream:
        for ch in chunk.choices:
            piece = (ch.delta.content or "") if chat else ch.text
            out[ch.index] = out.get(ch.index, "") + piece
    return out


def test_n_choices_completions_and_chat_streamed_and_not(tokenizer: Any) -> None:
    """n=3: three indexed choices (each its own seed) for completions and chat, streamed or not;
    the choices of a prompt go to one worker as siblings of the first."""
    h = make_harness(tokenizer, workers=2)

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, ...]:
        comp = await c.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=4, seed=7)
        chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                               max_tokens=4, seed=7)  # fmt: skip
        s1 = await _texts(await c.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=4, seed=7, stream=True))
        s2 = await _texts(await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                          n=3, max_tokens=4, seed=7, stream=True), chat=True)  # fmt: skip
        return comp, chat, s1, s2

    comp, chat, s1, s2 = _run(h, go)
    assert [ch.index for ch in comp.choices] == [0, 1, 2] and [ch.index for ch in chat.choices] == [0, 1, 2]
    assert len({ch.text for ch in comp.choices}) == 3  # seeds 7, 8, 9
    assert s1 == {ch.index: ch.text for ch in comp.choices}
    assert s2 == {ch.index: ch.message.content for ch in chat.choices}
    assert comp.usage.completion_tokens == 12 and comp.usage.prompt_tokens == len(tokenizer("Hello")["input_ids"])
    seen = [s for e in h.engines for s in e.seen]
    assert {s[1].seed for s in seen[:3]} == {7, 8, 9}
    assert [follows is None for _, _, follows in seen[:3]] == [True, False, False]


def test_batched_prompts_with_n(tokenizer: Any) -> None:
    """prompt lists (text and ids) with n=2: choice index = prompt * n + k, usage per prompt once."""
    h = make_harness(tokenizer, workers=2)

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, Any, Any]:
        text = await c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, temperature=0)
        ids = await c.completions.create(model=MODEL, prompt=[[10, 20], [30]], n=2, max_tokens=3, temperature=0)
        streamed = await _texts(await c.completions.create(model=MODEL, prompt=[[10, 20], [30]], n=2, max_tokens=3,
                                                           temperature=0, stream=True))  # fmt: skip
        return text, ids, streamed

    text, ids, streamed = _run(h, go)
    assert [ch.index for ch in text.choices] == [0, 1]
    assert [ch.index for ch in ids.choices] == [0, 1, 2, 3] and ids.usage.prompt_tokens == 3
    want = tokenizer.decode(expected_greedy([30], 3, len(tokenizer)), skip_special_tokens=True)
    assert ids.choices[2].text == ids.choices[3].text == want and streamed[3] == want


def test_best_of_keeps_the_most_likely(tokenizer: Any) -> None:
    """best_of=3, n=1 generates three choices and returns one, index 0."""
    h = make_harness(tokenizer)
    out = _run(h, lambda c: c.completions.create(model=MODEL, prompt="x", n=1, best_of=3, max_tokens=3))
    assert [ch.index for ch in out.choices] == [0] and out.choices[0].logprobs is None
    assert len(h.engines[0].seen) == 3 and all(p.logprobs == 0 for _, p, _ in h.engines[0].seen)


def test_echo_with_logprobs_and_max_tokens_zero(tokenizer: Any) -> None:
    """echo + logprobs=1 + max_tokens=0 (lm-eval's loglikelihood request): the text is the prompt,
    one logprob per prompt token (the first null), offsets that index the text."""
    h = make_harness(tokenizer)
    prompt = "Hello world"
    ids = tokenizer(prompt)["input_ids"]

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, Any]:
        zero = await c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        one = await c.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
        return zero, one

    zero, one = _run(h, go)
    lp = zero.choices[0].logprobs
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]
    assert all(zero.choices[0].text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    assert one.choices[0].text.startswith(prompt) and len(one.choices[0].logprobs.tokens) == len(ids) + 1


def test_prompt_logprobs_extension(tokenizer: Any) -> None:
    """vLLM's prompt_logprobs: one entry per prompt token, the first null, in completions and chat."""
    h = make_harness(tokenizer)

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, Any]:
        a = await c.completions.with_raw_response.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1,
                                                         extra_body={"prompt_logprobs": 0})  # fmt: skip
        b = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=1, extra_body={"prompt_logprobs": 0})
        return json.loads(a.text), json.loads(b.text)

    a, b = _run(h, go)
    pl = a["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and list(pl[1]) == ["6"] and pl[1]["6"]["logprob"] == -1.0
    assert b["choices"][0]["prompt_logprobs"][0] is None


def test_sampling_controls_reach_the_engine(tokenizer: Any) -> None:
    """Penalties, logit_bias, min_tokens, ignore_eos, 10 stop strings and a 2**70 seed are honoured."""
    h = make_harness(tokenizer)
    stops = [f"zz{i}" for i in range(10)]
    extra = {"repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True, "skip_special_tokens": False, "top_k": 5}
    out = _run(h, lambda c: c.completions.create(
        model=MODEL, prompt="x", max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": 5},
        stop=stops, seed=2**70, extra_body=extra))  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    p = h.engines[0].seen[0][1]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == ((17, 5.0),) and p.min_tokens == 2 and p.ignore_eos and p.stop == tuple(stops)
    assert p.seed == 2**70 and p.top_k == 5


@pytest.mark.parametrize(
    "body,grammar",
    [
        ({"response_format": {"type": "json_object"}}, Grammar("json_schema", '{"type": "object"}')),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
         Grammar("json_schema", '{"type": "integer"}')),
        ({"guided_json": {"type": "boolean"}}, Grammar("json_schema", '{"type": "boolean"}')),
        ({"guided_regex": "a+"}, Grammar("regex", "a+")),
        ({"guided_choice": ["yes", "no"]}, Grammar("choice", choices=("yes", "no"))),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, Grammar("lark", 'start: "a"')),
    ],
)  # fmt: skip
def test_structured_output_spellings(tokenizer: Any, body: dict[str, Any], grammar: Grammar) -> None:
    """Every spelling becomes the one grammar the worker compiles (completions and chat)."""
    h = make_harness(tokenizer)

    async def go(c: openai.AsyncOpenAI) -> None:
        await c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)
        await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=2,
                                        extra_body=body)  # fmt: skip

    _run(h, go)
    assert [p.grammar for _, p, _ in h.engines[0].seen] == [grammar, grammar]


def test_tool_choice_named_and_required_force_a_call(tokenizer: Any) -> None:
    """Named: the function's parameters schema is the grammar, the output its arguments;
    required: a JSON list of calls; none: plain content."""
    h = make_harness(tokenizer, max_model_len=400)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
    msgs = [{"role": "user", "content": "Weather?"}]

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, Any]:
        named = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=3,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
        none = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="none", max_tokens=3)
        await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required", max_tokens=3)
        return named, none

    named, none = _run(h, go)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert named.choices[0].finish_reason in ("tool_calls", "length") and none.choices[0].message.tool_calls is None
    grammars = [p.grammar for _, p, _ in h.engines[0].seen]
    assert json.loads(grammars[0].text) == tools[0]["function"]["parameters"] and grammars[1] is None
    assert json.loads(grammars[2].text)["minItems"] == 1


def test_assistant_tool_calls_and_tool_messages_render(tokenizer: Any) -> None:
    """An assistant tool_calls turn, a tool result and empty content are accepted (200)."""
    h = make_harness(tokenizer)
    msgs = [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip
    out = _run(h, lambda c: c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                      extra_body={"chat_template_kwargs": {"x": 1}}))  # fmt: skip
    assert out.choices[0].message.role == "assistant"
    prompt = tokenizer.decode(h.engines[0]._history[0][1])
    assert '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' in prompt and "<|tool|>42" in prompt


def test_auto_tool_calls_parsed_from_the_model_output(tokenizer: Any) -> None:
    """tool_choice auto: tools reach the template; a Hermes call in the output becomes tool_calls,
    streamed as a tool_calls delta too; the text before it is content."""
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    h = make_harness(tokenizer, script=tokenizer(text)["input_ids"], max_model_len=400)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather?"}]

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, list[Any]]:
        whole = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=200)
        chunks = [x async for x in await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                                                   max_tokens=200, stream=True)]  # fmt: skip
        return whole, chunks

    whole, chunks = _run(h, go)
    msg = whole.choices[0].message
    assert msg.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather" and json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert "get_weather" in tokenizer.decode(h.engines[0]._history[0][1])
    deltas = [tc for ch in chunks for x in ch.choices for tc in (x.delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason] == ["tool_calls"]


def test_guard_counts_a_client_gone_before_headers_as_499(tokenizer: Any) -> None:
    """The request counter records 499 when the handler is cancelled before the response starts."""
    from deploy.openai.ingress import DrainGate, GuardMiddleware, IngressOptions
    from deploy.openai.service import ServiceOptions

    h = make_harness(tokenizer)
    started = asyncio.Event()

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        started.set()
        await asyncio.Event().wait()

    options = IngressOptions(service=ServiceOptions(model_name=MODEL))
    guard = GuardMiddleware(slow_app, options, h.service.metrics, DrainGate())

    async def go() -> None:
        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
        task = asyncio.create_task(guard(scope, None, None))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert h.service.metrics.requests.labels("/v1/completions", "499")._value.get() == 1


def test_seeds_beyond_64_bits(tokenizer: Any) -> None:
    """Seeds >= 2**64 are served (they reach the engine whole)."""
    h = make_harness(tokenizer)
    out = _run(h, lambda c: c.completions.create(model=MODEL, prompt="x", max_tokens=2, seed=2**64 + 3))
    assert out.choices[0].finish_reason == "length" and h.engines[0].seen[0][1].seed == 2**64 + 3


def test_utility_routes(tokenizer: Any) -> None:
    """/openapi.json documents both request bodies, /docs is served, /tokenize and /detokenize
    round-trip, models.retrieve works and /v1/models carries root."""
    h = make_harness(tokenizer)

    async def go() -> tuple[Any, ...]:
        async with h.client() as http, _client(h) as c:
            spec = (await http.get("/openapi.json")).json()
            docs = await http.get("/docs")
            tok = (await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})).json()
            detok = (await http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]})).json()
            chat_tok = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
            bad = await http.post("/detokenize", json={"tokens": [10**9]})
            card = await c.models.retrieve(MODEL)
            missing = await http.get("/v1/models/nope")
            listing = (await http.get("/v1/models")).json()
            return spec, docs, tok, detok, chat_tok, bad, card, missing, listing

    spec, docs, tok, detok, chat_tok, bad, card, missing, listing = asyncio.run(go())
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest") and "CompletionRequest" in spec["components"]["schemas"]
    assert "ChatCompletionRequest" in spec["components"]["schemas"] and docs.status_code == 200
    assert tok["count"] == len(tok["tokens"]) > 0 and detok["prompt"].endswith("Hello world")
    assert chat_tok["count"] > 0 and bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert card.id == MODEL and missing.status_code == 404
    assert listing["data"][0]["root"] == MODEL


def test_text_offset_skips_special_tokens(tokenizer: Any) -> None:
    """A generated special token adds no text: its offset equals the next token's, and every
    offset indexes the returned text."""
    h = make_harness(tokenizer)
    vocab = len(tokenizer)
    specials = {i for i in range(vocab) if tokenizer.decode([i], skip_special_tokens=True) == ""}
    start = next(x for x in range(10, vocab) if (x * 31 + 7) % vocab in specials)
    out = _run(h, lambda c: c.completions.create(model=MODEL, prompt=[start], max_tokens=4, temperature=0, logprobs=0))
    lp, text = out.choices[0].logprobs, out.choices[0].text
    assert lp.text_offset[0] == lp.text_offset[1] == 0 and lp.tokens[0].startswith("<|")
    assert all(o <= len(text) for o in lp.text_offset) and text.startswith(lp.tokens[1])


ROWS = [
    ("n=2", {"n": 2, "seed": 5}),
    ("controls", {"presence_penalty": 0.5, "frequency_penalty": 0.2, "logit_bias": {"9": 3},
                  "extra_body": {"repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True}, "stop": ["q"] * 6}),
    ("seed 2**64", {"seed": 2**64 + 9}),
    ("json_object", {"extra_body": {"response_format": {"type": "json_object"}}}),
    ("guided_choice", {"extra_body": {"guided_choice": ["a", "b"]}}),
    ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}}),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_row_streams_as_it_answers(tokenizer: Any, row: tuple[str, dict[str, Any]], chat: bool) -> None:
    """Each row through the openai client, completions and chat: the streamed text of every
    choice equals the non-streamed one, with the same finish reasons."""
    h = make_harness(tokenizer)
    kw = {"model": MODEL, "max_tokens": 5, **row[1]}

    async def go(c: openai.AsyncOpenAI) -> tuple[Any, dict[int, str], dict[int, str]]:
        if chat:
            msgs = [{"role": "user", "content": "Hi"}]
            whole = await c.chat.completions.create(messages=msgs, **kw)
            stream = await c.chat.completions.create(messages=msgs, stream=True, **kw)
        else:
            whole = await c.completions.create(prompt="Hello", **kw)
            stream = await c.completions.create(prompt="Hello", stream=True, **kw)
        texts, finish = {}, {}
        async for chunk in stream:
            for ch in chunk.choices:
                piece = (ch.delta.content or "") if chat else ch.text
                texts[ch.index] = texts.get(ch.index, "") + piece
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        return whole, texts, finish

    whole, texts, finish = _run(h, go)
    want = {ch.index: (ch.message.content if chat else ch.text) for ch in whole.choices}
    assert texts == want and finish == {ch.index: ch.finish_reason for ch in whole.choices}


def test_streamed_echo_starts_with_the_prompt(tokenizer: Any) -> None:
    """echo while streaming: each choice's first chunk starts with the prompt (and its logprobs)."""
    h = make_harness(tokenizer)

    async def go(c: openai.AsyncOpenAI) -> list[Any]:
        stream = await c.completions.create(model=MODEL, prompt="Hello", n=2, echo=True, logprobs=0, max_tokens=3,
                                            stream=True)  # fmt: skip
        return [chunk async for chunk in stream]

    chunks = _run(h, go)
    firsts = {}
    for chunk in chunks:
        for ch in chunk.choices:
            firsts.setdefault(ch.index, ch)
    assert sorted(firsts) == [0, 1]
    n_prompt = len(tokenizer("Hello")["input_ids"])
    for ch in firsts.values():
        assert ch.text.startswith("Hello") and ch.logprobs.token_logprobs[0] is None
        assert len(ch.logprobs.tokens) >= n_prompt


def test_best_of_ranks_by_cumulative_logprob() -> None:
    """best_of keeps, per prompt, the choices with the highest summed logprob, reindexed."""
    from core.outputs import TokenLogprob
    from deploy.openai.choices import ChoiceState, best_of

    def choice(index: int, prompt: int, lps: list[float]) -> ChoiceState:
        c = ChoiceState(index, prompt, f"r{index}", None)  # type: ignore[arg-type]
        c.logprobs = [TokenLogprob(1, v) for v in lps]
        return c

    cs = [choice(0, 0, [-1, -1]), choice(1, 0, [-0.1, -0.2]), choice(2, 0, [-3]),
          choice(3, 1, [-5]), choice(4, 1, [-0.5]), choice(5, 1, [-9])]  # fmt: skip
    kept = best_of(cs, [0, 1], keep=1)
    assert [(c.request_id, c.index) for c in kept] == [("r1", 0), ("r4", 1)]

"""The API key on every route but /health; /metrics by its own switch and key; /v1/models shows
no path; every response carries a request id (in-process ingress, fake engines)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.deploy.openai.openai_harness import MODEL, make_harness
from tests.fakes.tokenizer import make_tokenizer_dir

KEY, SCRAPER = "s3cret", "scrape-only"
ROUTES = [  # (method, path, body): every route a client can reach
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/metrics", None),
    ("GET", "/no-such-route", None),
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _statuses(h: Any, key: str | None, routes: list[tuple[str, str, Any]] = ROUTES) -> dict[str, int]:
    async def go() -> dict[str, int]:
        async with h.client() as c:
            return {path: (await c.request(method, path, json=body, headers=_bearer(key))).status_code
                    for method, path, body in routes}  # fmt: skip

    return asyncio.run(go())


def test_every_route_but_health_needs_the_key(tokenizer: Any) -> None:
    """With an API key, every route (the utility routes, the docs, the schema, /metrics and
    unknown paths) answers 401 without it or with a wrong one, in OpenAI's shape; /health does
    not ask."""
    h = make_harness(tokenizer, api_key=KEY)
    assert set(_statuses(h, None).values()) == set(_statuses(h, "wrong").values()) == {401}
    right = _statuses(h, KEY)
    assert right.pop("/no-such-route") == 404 and set(right.values()) == {200}, right

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            return await c.get("/health"), await c.get("/v1/models")

    health, refused = asyncio.run(go())
    assert health.status_code == 200
    assert refused.json()["error"] == {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                       "type": "authentication_error", "param": None, "code": "invalid_api_key"}  # fmt: skip


def test_metrics_take_their_own_key_which_opens_nothing_else(tokenizer: Any) -> None:
    """A metrics key (a scraper's) opens /metrics and nothing else; the API key opens /metrics too."""
    h = make_harness(tokenizer, api_key=KEY, metrics_key=SCRAPER)
    scraper = _statuses(h, SCRAPER)
    assert scraper.pop("/metrics") == 200 and set(scraper.values()) == {401}, scraper
    assert _statuses(h, KEY)["/metrics"] == 200
    assert _statuses(h, None)["/metrics"] == 401


def test_metrics_auth_off_opens_metrics_alone(tokenizer: Any) -> None:
    """metrics_auth false: /metrics answers without a key; everything else still needs one."""
    h = make_harness(tokenizer, api_key=KEY, metrics_auth=False)
    anyone = _statuses(h, None)
    assert anyone.pop("/metrics") == 200 and set(anyone.values()) == {401}


def test_a_metrics_key_alone_guards_metrics_alone(tokenizer: Any) -> None:
    """No API key but a metrics key: the API is open, /metrics is not."""
    h = make_harness(tokenizer, metrics_key=SCRAPER)
    anyone = _statuses(h, None)
    assert anyone.pop("/metrics") == 401 and anyone.pop("/no-such-route") == 404
    assert set(anyone.values()) == {200} and _statuses(h, SCRAPER)["/metrics"] == 200


def test_model_card_root_is_the_model_id(tokenizer: Any) -> None:
    """/v1/models and /v1/models/{id} name the served model as `root`, never a directory."""
    h = make_harness(tokenizer)

    async def go() -> tuple[Any, Any]:
        async with h.client() as c:
            return (await c.get("/v1/models")).json(), (await c.get(f"/v1/models/{MODEL}")).json()

    listing, card = asyncio.run(go())
    assert listing["data"][0]["root"] == card["root"] == MODEL


def test_every_response_carries_a_request_id(tokenizer: Any) -> None:
    """x-request-id on answers, refusals and errors: the client's own when it is plain, a fresh
    one (not the client's) when it is not; a 401 carries one too."""
    h = make_harness(tokenizer, api_key=KEY)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}

    async def go() -> list[Any]:
        async with h.client() as c:
            return [
                await c.post("/v1/completions", json=body, headers={**_bearer(KEY), "x-request-id": "bench-1"}),
                await c.post("/v1/completions", json=body, headers={**_bearer(KEY), "x-request-id": "a b\x7f" * 50}),
                await c.post("/v1/completions", json={"model": MODEL}, headers=_bearer(KEY)),
                await c.get("/v1/models", headers={"x-request-id": "mine"}),
                await c.get("/health"),
            ]

    own, odd, bad, refused, health = asyncio.run(go())
    assert own.status_code == 200 and own.headers["x-request-id"] == "bench-1"
    assert odd.headers["x-request-id"].startswith("req-") and bad.status_code == 400
    assert bad.headers["x-request-id"].startswith("req-") and bad.headers["x-request-id"] != odd.headers["x-request-id"]
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "mine"
    assert health.headers["x-request-id"].startswith("req-")

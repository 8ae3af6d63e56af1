"""The HTTP surface: a FastAPI app over `OpenAIService`, and the Serve ingress deployment class.

`create_app(service, options)` is plain FastAPI (tests drive it with httpx's ASGI transport);
`IngressDeployment` builds the service inside the replica (tokenizer from the model directory,
a `ServeWorkerClient` around the worker handle) and hands Serve the app through
`__serve_build_asgi_app__`, so the same app object serves in and out of Ray.

| concern | where | answer |
|---|---|---|
| auth | `GuardMiddleware`: every route but `/health`; `/metrics` per `metrics_auth`, with the API key or `metrics_key`; the key from the config or `with_key_file` | 401 without `Authorization: Bearer <key>` |
| request id | `GuardMiddleware`: the client's `x-request-id` or a new one (`deploy/openai/errors.py`) | `x-request-id` on every response; a 5xx names it |
| body size | `GuardMiddleware` (Content-Length) and `_read_body` (actual bytes) | 413, after reading the rest (`drain_body`) |
| overload | `Admission` (sequences and tokens in flight) / worker backpressure | 429 / 503 + `Retry-After` |
| deadline, slow reader | `request_timeout_s` (`OpenAIService`), `WriteTimeout` | 504 (a stream: an error event); the connection closed |
| shutdown | `DrainGate`, closed by `IngressDeployment.close` (SIGTERM, every replica) | 503 + `Retry-After`; `/health` 503 |
| any error | `APIError` handler, plus 404/405/500 mapped to the same shape, nothing internal (`errors.public`) | `{"error": {...}}` |
| client gone before headers | `GuardMiddleware` | counted as 499 in `/metrics` |
| schema | `deploy.openai.openapi` (`/openapi.json`, `/docs`); `/tokenize` etc. in `utility_routes` | |
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.config import api_key_from_file
from deploy.metrics import CONTENT_TYPE, IngressMetrics
from deploy.openai.bodies import ChatCompletionResponse, CompletionResponse
from deploy.openai.errors import REQUEST_ID_HEADER, internal_error, public, request_id
from deploy.openai.openapi import body_spec, install_openapi
from deploy.openai.schema import APIError, ChatCompletionRequest, CompletionRequest, overloaded
from deploy.openai.service import OpenAIService, Reply, ServiceOptions
from deploy.openai.streaming import SSE_DONE
from deploy.openai.utility_routes import add_utility_routes
from deploy.openai.write_timeout import BODY_SEND, WriteTimeout
from deploy.replica.heap import settle_heap

log = logging.getLogger("swaserve.ingress")
CLIENT_CLOSED = 499  # nginx's status for a client that hung up before the response


@dataclass(frozen=True)
class IngressOptions:
    service: ServiceOptions
    api_key: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    model: str = "tiny"  # 'tiny' or a local HF directory: where the tokenizer comes from
    metrics_auth: bool = True  # /metrics asks for a key (the API key or metrics_key) when one is set
    metrics_key: str | None = None  # a key for /metrics alone (a scraper's)
    write_timeout_s: float = 30.0  # one response write waiting on the client longer: cut off
    # Answer with `x-request-id`; False under Serve, whose HTTP servers (its proxy, direct
    # ingress) already add it: the client's, or the one they put in the request's headers.
    request_id_header: bool = True


def with_key_file(options: IngressOptions) -> IngressOptions:
    """`options` with the API key from `SWASERVE_API_KEY_FILE` when none came with them: on
    Kubernetes the chart mounts the key as that file in the pods that host this replica only."""
    if options.api_key:
        return options
    return dataclasses.replace(options, api_key=api_key_from_file())


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def to_response(reply: Reply) -> Response:
    if reply.events is not None:
        headers = {**reply.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return _ClosingStream(reply.events, media_type="text/event-stream", headers=headers)
    assert reply.body is not None
    return Response(reply.body, media_type="application/json", headers=reply.headers)


class _ClosingStream(StreamingResponse):
    """Closes its event generator however the response ends: a write that failed or timed out
    (`WriteTimeout`) leaves the generator suspended at a `yield`, and only closing it runs its
    `finally` (the worker streams closed, the request aborted, its admission share back) at
    once rather than whenever it is collected (an exception's traceback can keep it for a
    garbage collection).

    NOTE: the close is a task of its own, not awaited here: this `finally` may run inside a
    cancelled anyio scope (the client gone), where every await is cancelled again, and the
    generator's `finally` would stop at its first await.

    Under the replica's own HTTP server the middle chunks go straight to the server's bounded
    `send` (`write_timeout.BODY_SEND`), one write per streamed token past six ASGI layers that
    act only on a response's first and last messages (which still take the whole way).

    The stream's `[DONE]` event is its last: it goes out as the response's last message, so the
    client has the whole response before the generator's cleanup (its `finally`: the worker
    streams closed, the admission share back) runs in the closing task. A closed-loop client
    sends its next request as each response ends: when a step finishes many streams, every one
    of them ends before any cleanup, and their next requests reach the engine closer together
    (BENCHMARKS "vllm-compare", runs AE and AF: the waves)."""

    _body_send: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._body_send = scope.get(BODY_SEND)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        body_send = self._body_send or send
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if chunk == SSE_DONE:
                    await send({"type": "http.response.body", "body": _DONE_BYTES, "more_body": False})
                    return
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            closing = asyncio.ensure_future(self.body_iterator.aclose())  # type: ignore[attr-defined]
            _CLOSING.add(closing)  # the loop holds tasks weakly
            closing.add_done_callback(_CLOSING.discard)


_CLOSING: set[asyncio.Future[None]] = set()
_DONE_BYTES = SSE_DONE.encode()


# An oversized body is read to its end (up to this much, for this long) before the 413 goes
# out: a server that answers and closes while the client is still sending makes the client's
# kernel see unread data on a closed socket, a reset, and most clients then report "Connection
# reset by peer" instead of the answer. Past either bound the client may see that reset.
MAX_DRAIN_BYTES = 256 << 20
DRAIN_TIMEOUT_S = 30.0


async def drain_body(receive: Any) -> int:
    """Read and discard the rest of a request body (within the bounds); returns the bytes read."""
    seen, limit, timeout_s = 0, MAX_DRAIN_BYTES, DRAIN_TIMEOUT_S

    async def read() -> None:
        nonlocal seen
        while seen <= limit:
            message = await receive()
            seen += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        log.warning("gave up draining an oversized body after %.0fs (%d bytes)", timeout_s, seen)
    return seen


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await drain_body(request.receive)  # before the 413: see MAX_DRAIN_BYTES
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class DrainGate:
    """Open while serving; closed when the server drains before stopping: new generation
    requests get 503 + `Retry-After` (a client or balancer retries another instance) and
    `/health` 503, while the requests in flight finish."""

    def __init__(self) -> None:
        self.closed = False


def create_app(service: OpenAIService, options: IngressOptions) -> FastAPI:
    app = FastAPI(title="swaserve", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, options.service.model_name)
    metrics = service.metrics
    app.state.drain = gate = DrainGate()

    app.add_middleware(GuardMiddleware, options=options, metrics=metrics, gate=gate)
    app.add_middleware(WriteTimeout, timeout_s=options.write_timeout_s)  # around GuardMiddleware

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(public(e, _rid(request)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code in (404, 405):  # OpenAI's wording for routes it does not serve
            message = f"Invalid URL ({request.method} {request.url.path}): {e.detail}"
        return error_response(public(APIError(e.status_code, message), _rid(request)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # NOTE: Starlette answers this one outside every middleware (GuardMiddleware too), so
        # the request id header is set here.
        rid = _rid(request)
        response = error_response(public(internal_error(e), rid))
        if options.request_id_header:
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    @app.post("/v1/completions", openapi_extra=body_spec(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        raw = await _read_body(request, options.max_request_bytes)
        return to_response(await service.completions(raw, _rid(request)))

    @app.post("/v1/chat/completions", openapi_extra=body_spec(ChatCompletionRequest, ChatCompletionResponse))
    async def chat(request: Request) -> Response:
        raw = await _read_body(request, options.max_request_bytes)
        return to_response(await service.chat(raw, _rid(request)))

    @app.get("/v1/models")
    async def models() -> Response:
        return Response((await service.models()).model_dump_json(), media_type="application/json")

    add_utility_routes(app, service, options.service.model_name,
                       lambda request: _read_body(request, options.max_request_bytes))  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        snapshot = await service.replica_stats()
        up = sorted(r for r, s in snapshot.items() if s is not None)
        ready = bool(up) and len(up) == len(snapshot)
        body = {"status": "ok" if ready else "unavailable", "workers_ready": len(up), "workers": len(snapshot)}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        t0 = time.monotonic()
        snapshot = await service.replica_stats()
        log.debug("metrics scrape of %d replicas took %.3fs", len(snapshot), time.monotonic() - t0)
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE)

    return app


def _rid(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, which gets in the way of streaming and cancellation):
    the request id (`scope["state"]["request_id"]`, and the `x-request-id` response header),
    auth, the Content-Length limit, and a status counter on every response."""

    def __init__(
        self, app: Any, options: IngressOptions, metrics: IngressMetrics, gate: DrainGate
    ) -> None:
        self._app, self._options, self._metrics, self._gate = app, options, metrics, gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"]
        status = {"code": 500, "started": 0}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        scope.setdefault("state", {})["request_id"] = rid

        async def counting_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], 1
                if self._options.request_id_header:
                    message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
            await send(message)

        try:
            _check_auth(headers, self._keys(path))
            if self._gate.closed:
                _check_open(path, scope["method"], self._options.service.retry_after_s)
            _check_length(headers, self._options.max_request_bytes)
        except APIError as e:
            if e.status == 413:
                await drain_body(receive)  # before the answer: see MAX_DRAIN_BYTES
            await error_response(public(e, rid))(scope, receive, counting_send)
        else:
            try:
                await self._app(scope, receive, counting_send)
            except asyncio.CancelledError:
                if not status["started"]:
                    status["code"] = CLIENT_CLOSED  # the client left before the headers
                raise
        finally:
            self._metrics.requests.labels(_endpoint(path), str(status["code"])).inc()

    def _keys(self, path: str) -> tuple[str, ...]:
        """The keys `path` takes; none: it answers anyone. Only `/health` is always open (load
        balancers and Kubernetes probe it without credentials)."""
        o = self._options
        if path == "/health":
            return ()
        if path == "/metrics":
            return tuple(k for k in (o.api_key, o.metrics_key) if k) if o.metrics_auth else ()
        return (o.api_key,) if o.api_key else ()


def _check_auth(headers: dict[str, str], keys: tuple[str, ...]) -> None:
    if not keys:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    # Every key is compared (no early exit): the time taken says nothing about which one is close.
    matches = [hmac.compare_digest(sent, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(
            401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
            type="authentication_error", code="invalid_api_key",
        )  # fmt: skip


def _check_open(path: str, method: str, retry_after_s: int) -> None:
    if path == "/health" or (path.startswith("/v1/") and method == "POST"):
        raise overloaded(503, "server is shutting down; retry on another instance", retry_after_s)


def _check_length(headers: dict[str, str], limit: int) -> None:
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds {limit} bytes", code="request_too_large")


def _endpoint(path: str) -> str:
    known = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
    return path if path in known else "other"


@serve.ingress()
class IngressDeployment:
    """The Serve ingress replica: tokenizer + worker client + service; the app comes from
    `__serve_build_asgi_app__` (Serve calls it after `__init__`)."""

    def __init__(self, worker: DeploymentHandle, options: IngressOptions) -> None:
        from cluster.ray_private import direct_ingress_server
        from deploy.openai.chat_format import chat_format_for
        from deploy.replica.client import ServeWorkerClient
        from worker.models.model_dir import load_tokenizer, resolve_model_dir

        # `swaserve serve` binds this replica to its port: there the server's own writes wait
        # on the client, so the write timeout goes around the server's app (WriteTimeout).
        direct_ingress_server(lambda app: WriteTimeout(app, options.write_timeout_s, publish=True))
        options = dataclasses.replace(with_key_file(options), request_id_header=False)
        self._options = options
        model_dir = resolve_model_dir(options.model)
        tokenizer = load_tokenizer(model_dir)
        chat = chat_format_for(tokenizer, str(model_dir))
        self._service = OpenAIService(tokenizer, ServeWorkerClient(worker), options.service, chat_format=chat)
        self._app = create_app(self._service, options)
        # Start-up's objects frozen, so a collection landing inside a routing decision or an
        # SSE write scans only what requests allocated (the routing decision's p99 is set by
        # collections: BENCHMARKS "Routing at GPU-cluster rates"), and collections rarer.
        settle_heap()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def close(self) -> tuple[str, int]:
        """Close the gate (`DrainGate`; idempotent) and say which replica this is and how many
        generation requests it still has in flight. `swaserve serve` calls it on SIGTERM until
        every ingress replica has answered with 0 (`deploy.serve_local._drain`): a closed gate
        admits nothing, so a replica's count only falls from then on."""
        self._app.state.drain.closed = True
        return serve.get_replica_context().replica_id.unique_id, self._service.inflight

"""`cluster-compare`'s client: one request stream against one server, at a fixed concurrency.

`concurrency` tasks take requests from one queue ordered by the workload's arrival times (the
times order the queue only: the client is closed, never idle while work is queued), send each as
a streamed `/v1/completions` (text prompt, greedy, `ignore_eos`, `stream_options.include_usage`)
and, when it finishes, queue its closed-loop follow-up (`TextStream.follow_up`). The run ends when
the queue is empty and nothing is in flight. The same stream and seed go to every stack; the
order in which follow-ups join the queue depends on when their parents finish, so it can differ
between runs, the requests themselves cannot (up to the answers' text).

Per request: time to the first chunk with text, latency, usage (prompt, completion and, where the
server reports it, cached tokens) and, from swaserve's response headers, the worker replica that
served it and the router's predicted cached and repaired tokens (None from a server that does not
send them). A request that fails (HTTP error, an error chunk, a broken stream) is counted and its
session ends there.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import time
from dataclasses import dataclass
from typing import Any

from bench.compare.streams import StreamRequest, TextStream
from deploy.openai.headers import (
    PREDICTED_CACHED_TOKENS_HEADER,
    PREDICTED_REPAIRED_TOKENS_HEADER,
    REPLICA_HEADER,
)


@dataclass(frozen=True)
class RequestResult:
    rid: str
    prompt_chars: int
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    replica: str | None = None  # swaserve's `x-swaserve-replica`
    predicted_cached_tokens: int | None = None  # swaserve's router's prediction for the replica
    predicted_repaired_tokens: int | None = None  # ... and of the tokens it recomputes to repair


@dataclass(frozen=True)
class StreamRun:
    results: tuple[RequestResult, ...]
    duration_s: float
    # NOTE: follow-ups get their ids in the order their parents finish, so a stream is compared
    # by its prompts alone: sha256 of the sorted texts (equal streams, equal digests).
    prompts_digest: str
    prompts: tuple[str, ...]  # every prompt sent, sorted


async def run_stream(
    url: str, model: str, stream: TextStream, concurrency: int, timeout_s: float = 600.0
) -> StreamRun:
    """Send every request of `stream` to `url` with `concurrency` in flight at most."""
    import httpx

    queue: list[tuple[float, int, StreamRequest]] = []
    for i, r in enumerate(stream.initial()):
        heapq.heappush(queue, (r.sim.arrival_s, i, r))
    state = {"in_flight": 0, "pushed": len(queue)}
    changed = asyncio.Condition()
    sent: dict[str, str] = {}
    results: list[RequestResult] = []

    async def one_task(client: httpx.AsyncClient) -> None:
        while True:
            async with changed:
                await changed.wait_for(lambda: bool(queue) or state["in_flight"] == 0)
                if not queue:
                    return
                req = heapq.heappop(queue)[2]
                state["in_flight"] += 1
            sent[req.rid] = req.text
            result, answer = await _send(client, model, req)
            results.append(result)
            nxt = stream.follow_up(req, answer) if result.ok else None
            async with changed:
                if nxt is not None:
                    heapq.heappush(queue, (nxt.sim.arrival_s, state["pushed"], nxt))
                    state["pushed"] += 1
                state["in_flight"] -= 1
                changed.notify_all()

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        await asyncio.gather(*(one_task(client) for _ in range(concurrency)))
    duration = time.perf_counter() - t0
    prompts = tuple(sorted(sent.values()))
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return StreamRun(tuple(sorted(results, key=lambda r: r.rid)), duration, digest, prompts)


async def _send(client: Any, model: str, req: StreamRequest) -> tuple[RequestResult, str]:
    body = {"model": model, "prompt": req.text, "max_tokens": req.sim.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    headers: dict[str, str] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            headers = dict(resp.headers)
            if resp.status_code != 200:
                return _failed(req, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _failed(req, f"error chunk: {str(chunk['error'])[:200]}"), ""
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece and first is None:
                    first = time.perf_counter()
                pieces.append(piece)
                usage = chunk.get("usage") or usage
    except Exception as exc:  # noqa: BLE001 - any transport failure fails this request only
        return _failed(req, f"{type(exc).__name__}: {exc}"[:200]), ""
    end = time.perf_counter()
    if usage is None:
        return _failed(req, "no usage chunk"), ""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    predicted, repaired = (headers.get(h) for h in (PREDICTED_CACHED_TOKENS_HEADER,
                                                    PREDICTED_REPAIRED_TOKENS_HEADER))  # fmt: skip
    result = RequestResult(
        req.rid, len(req.text), True, "", int(usage["prompt_tokens"]),
        None if cached is None else int(cached), int(usage["completion_tokens"]),
        (first or end) - t0, end - t0, headers.get(REPLICA_HEADER),
        _int(predicted), _int(repaired),
    )  # fmt: skip
    return result, "".join(pieces)


def _int(header: str | None) -> int | None:
    """A one-choice request's header value (None when absent or empty)."""
    return int(header) if header else None


def _failed(req: StreamRequest, why: str) -> RequestResult:
    return RequestResult(req.rid, len(req.text), False, why)

"""Steady HTTP load for fault tests, and what each client saw.

`Load` runs `streams` streaming and `plains` non-streaming client loops on a thread of its own,
each a conversation of its own (a prompt that grows by one turn per request, a new one every
`turns`), against 127.0.0.1 only. Every request is classified:

| outcome | meaning |
|---|---|
| `completed` | 200 and the whole answer (`[DONE]` for a stream) |
| `clean` | failed cleanly: 503 with `Retry-After` before the first byte, or an SSE `error` event and then a clean end of the stream |
| `unclean` | anything else: a reset, a 500, a stream cut without an error event |
| `hung` | no end within `request_timeout_s` |

The load stops by itself after `max_s` or `max_requests`, whichever comes first.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Record:
    kind: str  # "stream" | "plain"
    client: int
    sent: float  # time.monotonic()
    answered: float = 0.0  # the status line arrived
    first_token: float = 0.0  # a stream's first data event arrived (headers may come before it)
    ended: float = 0.0
    outcome: str = ""
    status: int = 0
    replica: str = ""
    predicted: int | None = None
    cached: int | None = None
    error: str = ""

    @property
    def exact(self) -> bool:
        return self.outcome != "completed" or self.predicted == self.cached


@dataclass
class Load:
    url: str
    model: str = "tiny"
    streams: int = 3
    plains: int = 3
    max_tokens: int = 24
    turns: int = 6
    request_timeout_s: float = 60.0
    max_s: float = 600.0
    max_requests: int = 5000
    records: list[Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._extra: list[asyncio.Task[None]] = []  # send_long_stream's requests

    def start(self) -> Load:
        self._thread.start()
        assert self._ready.wait(30), "the load's client did not start"
        return self

    def send_long_stream(self, max_tokens: int) -> Record:
        """One streaming request of `max_tokens` beside the loops, recorded with them: a fault
        test waits for its first token and then kills what serves it, knowing that the stream
        still had most of its tokens to go (a loop's short stream may already be whole on the
        server while its client reads it)."""
        assert self._loop is not None and self._http is not None
        rec = Record("stream", -1, time.monotonic())
        self.records.append(rec)
        prompt = [random.Random(-1).randrange(5, 1000) for _ in range(160)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        http, loop = self._http, self._loop
        loop.call_soon_threadsafe(lambda: self._extra.append(loop.create_task(self._tracked(http, body, True, rec))))
        return rec

    def stop(self) -> list[Record]:
        self._stop.set()
        self._thread.join(self.request_timeout_s + 30)
        assert not self._thread.is_alive(), "the load did not stop"
        return self.records

    def since(self, t: float) -> list[Record]:
        return [r for r in list(self.records) if r.sent >= t]

    async def _main(self) -> None:
        end = time.monotonic() + self.max_s
        limits = httpx.Limits(max_connections=self.streams + self.plains + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.request_timeout_s, limits=limits) as http:
            self._loop, self._http = asyncio.get_running_loop(), http
            self._ready.set()
            loops = [self._client(http, i, i < self.streams, end) for i in range(self.streams + self.plains)]
            await asyncio.gather(*loops)
            await asyncio.gather(*self._extra)

    async def _client(self, http: httpx.AsyncClient, i: int, stream: bool, end: float) -> None:
        rng = random.Random(i)
        prompt: list[int] = []
        turn = 0
        while not self._stop.is_set() and time.monotonic() < end and len(self.records) < self.max_requests:
            if turn % self.turns == 0:
                prompt = [rng.randrange(5, 1000) for _ in range(160)]
            prompt = prompt + [rng.randrange(5, 1000) for _ in range(16)]
            turn += 1
            rec = Record("stream" if stream else "plain", i, time.monotonic())
            self.records.append(rec)
            body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True}
            await self._tracked(http, body, stream, rec)
            if rec.outcome != "completed":
                await asyncio.sleep(0.2)  # a client backs off after a failure (Retry-After: 1)

    async def _tracked(self, http: httpx.AsyncClient, body: dict, stream: bool, rec: Record) -> None:
        try:
            await asyncio.wait_for(self._one(http, body, stream, rec), self.request_timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            rec.outcome = "hung"
        except httpx.HTTPError as e:
            rec.outcome, rec.error = "unclean", repr(e)[:200]
        rec.ended = time.monotonic()

    async def _one(self, http: httpx.AsyncClient, body: dict, stream: bool, rec: Record) -> None:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            rec.status = r.status_code
            self._headers(rec, r.headers)
            if r.status_code == 200:
                usage = r.json()["usage"]
                rec.cached = usage["prompt_tokens_details"]["cached_tokens"]
                done = usage["completion_tokens"] == body["max_tokens"]
                rec.outcome = "completed" if done else "unclean"
            else:
                rec.error = r.text[:200]
                rec.outcome = "clean" if r.status_code == 503 and r.headers.get("retry-after") else "unclean"
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            rec.status = r.status_code
            self._headers(rec, r.headers)
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:200]
                rec.outcome = "clean" if r.status_code == 503 and r.headers.get("retry-after") else "unclean"
                return
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    rec.first_token = rec.first_token or time.monotonic()
                    events.append(line[6:])
        # The body ended cleanly (a cut stream raises above): was it whole, or an error event?
        if events and events[-1] == "[DONE]":
            usage = json.loads(events[-2])["usage"]
            rec.cached = usage["prompt_tokens_details"]["cached_tokens"]
            rec.outcome = "completed"
        elif events and "error" in json.loads(events[-1]):
            rec.outcome, rec.error = "clean", events[-1][:200]
        else:
            rec.outcome, rec.error = "unclean", f"stream ended without [DONE]: {events[-1:]}"

    @staticmethod
    def _headers(rec: Record, headers: httpx.Headers) -> None:
        rec.answered = time.monotonic()
        rec.replica = headers.get("x-swaserve-replica", "")
        predicted = headers.get("x-swaserve-predicted-cached-tokens")
        rec.predicted = int(predicted) if predicted else None


def counts(records: list[Record]) -> dict[str, int]:
    out = {"completed": 0, "clean": 0, "unclean": 0, "hung": 0}
    for r in records:
        if r.outcome:
            out[r.outcome] += 1
    return out


def exact_again_after(records: list[Record], t_fault: float) -> float:
    """Seconds from the fault to the send of the first request after which every answer's
    prediction equalled its cached tokens (0 when none was wrong after the fault)."""
    after = sorted((r for r in records if r.sent >= t_fault and r.outcome), key=lambda r: r.sent)
    wrong = [i for i, r in enumerate(after) if not r.exact]
    if not wrong:
        return 0.0
    if wrong[-1] + 1 >= len(after):
        return float("inf")
    return after[wrong[-1] + 1].sent - t_fault

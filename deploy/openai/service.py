"""The OpenAI endpoints' logic, independent of FastAPI and Ray.

A request goes: admission (bounded in-flight counter -> 429) -> strict parse -> tokenize (chat
template for chat) -> `SamplingParams` -> one worker stream per choice -> the first item of each
stream (`StreamStart`: replica id, or a refusal -> 400/503) -> a JSON body or SSE events.
Leaving early (client gone, stop string) closes the worker streams, which aborts the requests
on the workers and frees their KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from cluster.messages import RoutedRequest, StreamStart
from deploy.metrics import IngressMetrics
from deploy.openai.checks import check_chat, check_completion, sampling_params
from deploy.openai.choices import ChoiceState, merged, usage_of
from deploy.openai.detokenize import StopTextStream
from deploy.openai.headers import PREDICTED_CACHED_TOKENS_HEADER, REPLICA_HEADER, repair_headers
from deploy.openai.prompts import PromptBuilder
from deploy.openai.responses import ResponseBuilder
from deploy.openai.schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    overloaded,
    parse_request,
)
from deploy.openai.streaming import RequestTimer, from_model, sse, translate_worker_error
from deploy.replica.client import ReplicaSnapshot, WorkerClient
from router import ingress_signal
from router.metrics import default_metrics as routing_metrics


@dataclass(frozen=True)
class ServiceOptions:
    model_name: str
    max_inflight: int = 256  # generation requests in flight at this ingress; more -> 429
    retry_after_s: int = 1
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)


@dataclass(frozen=True)
class Reply:
    """What an endpoint produced: a JSON body or an SSE event stream, plus headers."""

    headers: dict[str, str]
    body: BaseModel | None = None
    events: AsyncIterator[str] | None = None


class OpenAIService:
    def __init__(
        self,
        tokenizer: Any,
        client: WorkerClient,
        options: ServiceOptions,
        metrics: IngressMetrics | None = None,
    ) -> None:
        self._tok = tokenizer
        self._client = client
        self._opts = options
        self.metrics = metrics or IngressMetrics()
        self._prompts = PromptBuilder(tokenizer)
        self._inflight = 0
        self._created = int(time.time())

    # -- endpoints -------------------------------------------------------------------------

    async def replica_stats(self) -> ReplicaSnapshot:
        return await self._client.replica_stats()

    async def models(self) -> ModelList:
        info = await self._client.info()
        card = ModelCard(id=self._opts.model_name, created=self._created, max_model_len=info.max_model_len)
        return ModelList(data=[card])

    async def completions(self, raw: bytes) -> Reply:
        with_release = self._admit()
        try:
            req: CompletionRequest = parse_request(CompletionRequest, raw)
            check_completion(req, self._opts.model_name)
            prompts = self._prompts.completion(req.prompt)
            return await self._run(req, prompts, chat=False, release=with_release)
        except BaseException:
            with_release()
            raise

    async def chat(self, raw: bytes) -> Reply:
        with_release = self._admit()
        try:
            req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
            check_chat(req, self._opts.model_name)
            prompts = [self._prompts.chat(req.messages)]
            return await self._run(req, prompts, chat=True, release=with_release)
        except BaseException:
            with_release()
            raise

    # -- admission ---------------------------------------------------------------------------

    def _admit(self) -> Callable[[], None]:
        """Take an in-flight slot or answer 429; returns an idempotent release."""
        if self._inflight >= self._opts.max_inflight:
            raise overloaded(
                429, f"server busy: {self._inflight} requests in flight (max_inflight="
                f"{self._opts.max_inflight}); retry later", self._opts.retry_after_s,
            )  # fmt: skip
        self._inflight += 1
        self.metrics.in_flight.set(self._inflight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._inflight -= 1
                self.metrics.in_flight.set(self._inflight)

        return release

    @property
    def inflight(self) -> int:
        return self._inflight

    # -- running -----------------------------------------------------------------------------

    async def _run(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        chat: bool,
        release: Callable[[], None],
    ) -> Reply:
        t0 = time.monotonic()
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}{id(req) & 0xFFFF:04x}"
        choices = []
        for p_idx, ids in enumerate(prompts):
            info = await self._client.info()
            params = sampling_params(req, len(ids), info.max_model_len, chat, self._opts.default_max_tokens)
            for k in range(req.n):
                seeded = params if params.seed is None or k == 0 else dataclasses.replace(params, seed=params.seed + k)
                index = p_idx * req.n + k
                request = RoutedRequest(
                    token_ids=ids, request_id=f"{base_id}-{index}", max_new_tokens=seeded.max_tokens, params=seeded
                )
                text = StopTextStream(self._tok, list(params.stop), context_ids=ids)
                choices.append(ChoiceState(index, p_idx, request, text))
        builder = ResponseBuilder(self._tok, base_id, self._opts.model_name, chat)
        endpoint = "chat" if chat else "completions"
        try:
            await self._start(choices)
        except BaseException:
            await _close_all(choices)
            raise
        headers = {REPLICA_HEADER: ",".join(dict.fromkeys(c.replica for c in choices))}
        predicted = [c.start.predicted_cached_tokens if c.start else None for c in choices]
        if any(p is not None for p in predicted):
            headers[PREDICTED_CACHED_TOKENS_HEADER] = ",".join("" if p is None else str(p) for p in predicted)
        headers.update(repair_headers([c.start.predicted_repaired_tokens if c.start else None for c in choices]))
        timer = RequestTimer(self.metrics, endpoint, t0)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(choices, builder, timer, include_usage, release)
            # NOTE: a generator that is never iterated (client gone before the body started)
            # never runs its `finally`; release the slot when it is collected instead.
            weakref.finalize(events, release)
            return Reply(headers, events=events)
        try:
            await self._collect(choices, timer)
            body = builder.final(choices, usage_of(choices))
            self._count_tokens(choices)
            headers.update(repair_headers([], [c.repaired_tokens for c in choices]))
            return Reply(headers, body=body)
        finally:
            timer.done()
            await _close_all(choices)
            release()

    async def _start(self, choices: list[ChoiceState]) -> None:
        starts = await asyncio.gather(*(self._open(c) for c in choices))
        refused = [s for s in starts if s.refusal is not None]
        if refused:
            s = refused[0]
            if s.refusal == "invalid":
                raise bad_request(s.message or "invalid request")
            raise overloaded(503, s.message or "worker unavailable", self._opts.retry_after_s)

    async def _open(self, c: ChoiceState) -> StreamStart:
        c.stream = self._client.stream(c.request)
        try:
            first = await c.stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "worker stream ended before it started", type="server_error") from None
        except Exception as e:  # noqa: BLE001 - translated into an HTTP status
            raise translate_worker_error(e, self._opts.retry_after_s) from e
        if not isinstance(first, StreamStart):
            raise APIError(500, f"worker sent {type(first).__name__} before StreamStart", type="server_error")
        c.replica, c.start = first.replica_id, first
        return first

    async def _collect(self, choices: list[ChoiceState], timer: RequestTimer) -> None:
        try:
            async for c, delta in merged(choices):
                if delta.error:
                    raise APIError(500, f"generation failed: {delta.error}", type="server_error")
                timer.tokens(len(delta.token_ids))
                c.consume(delta)
                if c.done:
                    await c.close()  # a stop string ends it early; harmless when finished
                    if all(x.done for x in choices):
                        return
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise translate_worker_error(e, self._opts.retry_after_s) from e

    async def _events(
        self,
        choices: list[ChoiceState],
        builder: ResponseBuilder,
        timer: RequestTimer,
        include_usage: bool,
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        try:
            if builder.chat:  # OpenAI opens each chat choice with a role-only delta
                for c in choices:
                    yield from_model(builder.first_chunk(c))
            async for c, delta in merged(choices):
                if delta.error:
                    yield sse(APIError(500, f"generation failed: {delta.error}", type="server_error").body())
                    return
                timer.tokens(len(delta.token_ids))
                piece = c.consume(delta)
                chunk = builder.chunk(c, piece.text, delta)
                if chunk is not None:
                    yield from_model(chunk)
                if c.done:
                    await c.close()
                    if all(x.done for x in choices):
                        break
            if include_usage:
                yield from_model(builder.usage_chunk(usage_of(choices)))
            self._count_tokens(choices)
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            err = e if isinstance(e, APIError) else translate_worker_error(e, self._opts.retry_after_s)
            yield sse(err.body())
        finally:
            timer.done()
            await _close_all(choices)
            release()

    def _count_tokens(self, choices: list[ChoiceState]) -> None:
        """Token counters, and the router's prediction against what the worker really reused."""
        for c in choices:
            # Before the client has its answer: tells the routers in this process that the
            # request is done and its cache events published (router/ingress_signal.py).
            ingress_signal.note_finished(c.request.request_id)
            if c.start and c.start.predicted_cached_tokens is not None and c.start.routing_policy:
                routing_metrics().observe_outcome(
                    c.start.routing_policy, c.start.predicted_cached_tokens, c.cached_tokens
                )
        u = usage_of(choices)
        self.metrics.prompt_tokens.inc(u.prompt_tokens)
        self.metrics.cached_tokens.inc(u.prompt_tokens_details.cached_tokens)
        self.metrics.count_repairs([c.repaired_tokens for c in choices])
        self.metrics.completion_tokens.inc(u.completion_tokens)


async def _close_all(choices: list[ChoiceState]) -> None:
    for c in choices:
        try:
            await c.close()
        except Exception:  # noqa: BLE001, S110 - closing must not mask the original outcome
            pass

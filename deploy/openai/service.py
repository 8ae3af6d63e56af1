"""The OpenAI endpoints' logic, independent of FastAPI and Ray.

A request goes: admission (bounded in-flight counter -> 429) -> strict parse -> tokenize (chat
format for chat) -> `SamplingParams` -> one worker stream per prompt carrying all of its choices
(`n`, or `best_of`; they share one prefill on one replica) -> the first item of each stream
(`StreamStart`: replica id, or a refusal -> 400/503) -> a JSON body or SSE events. Leaving early
(client gone) closes the worker streams, which aborts the requests on the workers and frees
their KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from cluster.messages import RoutedRequest, StreamStart
from deploy.metrics import IngressMetrics
from deploy.openai.bodies import ModelCard, ModelList
from deploy.openai.chat_format import ChatFormat, TemplateChat
from deploy.openai.checks import RequestChecks, sampling_params, sibling_params
from deploy.openai.choices import ChoiceState, best_of, usage_of
from deploy.openai.detokenize import StopTextStream
from deploy.openai.fanout import Fanout, PromptStream
from deploy.openai.headers import REPLICA_HEADER, prediction_headers, served_headers
from deploy.openai.limits import RequestLimits
from deploy.openai.prompts import PromptBuilder
from deploy.openai.responses import ResponseBuilder, Shape
from deploy.openai.schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    overloaded,
    parse_request,
)
from deploy.openai.streaming import RequestTimer, from_model, sse, translate_worker_error
from deploy.openai.structured import request_grammar
from deploy.replica.client import (
    DeathRecord,
    ReplicaSnapshot,
    WorkerClient,
    engine_died,
    replica_gone,
)
from router import routing_record
from router.metrics import default_metrics as routing_metrics

log = logging.getLogger("swaserve.ingress")

# Restarts of a non-streaming request whose worker replica was lost mid-generation (one at most
# when its engine died running it: `DeathRecord`).
PLAIN_RESTARTS = 2


def _lost_replica(err: APIError) -> bool:
    """The error came from a worker replica that died or went away (not from the request)."""
    return err.__cause__ is not None and replica_gone(err.__cause__)


def _placement(s: PromptStream) -> routing_record.Placement | None:
    """Where this process's router placed the stream's request, if that is the replica that
    serves it (the prediction is for that replica)."""
    if s.start is None:
        return None
    placed = routing_record.placement_of(s.request.request_id)
    return placed if placed is not None and placed.worker_id == s.start.replica_id else None


@dataclass(frozen=True)
class ServiceOptions:
    model_name: str
    max_inflight: int = 256  # generation requests in flight at this ingress; more -> 429
    retry_after_s: int = 1
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    model_root: str | None = None  # what /v1/models reports as `root`: the model directory
    limits: RequestLimits = RequestLimits()  # what one request may hold (README "Limits")


@dataclass(frozen=True)
class Reply:
    """What an endpoint produced: a JSON body or an SSE event stream, plus headers."""

    headers: dict[str, str]
    body: BaseModel | None = None
    events: AsyncIterator[str] | None = None


@dataclass
class _Run:
    """One generation request in flight: its streams, choices and how to answer."""

    req: CompletionRequest | ChatCompletionRequest
    fanout: Fanout
    choices: list[ChoiceState]
    builder: ResponseBuilder
    keep: int  # choices returned per prompt (n); more were generated when best_of > n
    deaths: DeathRecord  # replicas whose engine died running it, over its resends and restarts


class OpenAIService:
    def __init__(
        self,
        tokenizer: Any,
        client: WorkerClient,
        options: ServiceOptions,
        metrics: IngressMetrics | None = None,
        chat_format: ChatFormat | None = None,
    ) -> None:
        self._tok = tokenizer
        self._client = client
        self._opts = options
        self.metrics = metrics or IngressMetrics()
        self._prompts = PromptBuilder(tokenizer)
        self._checks = RequestChecks(options.model_name, len(tokenizer), options.limits)
        self._chat = chat_format or TemplateChat(tokenizer, "")
        self._inflight = 0
        self._created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self._tok

    # -- endpoints -------------------------------------------------------------------------

    async def replica_stats(self) -> ReplicaSnapshot:
        return await self._client.replica_stats()

    async def model_card(self) -> ModelCard:
        info = await self._client.info()
        root = self._opts.model_root or self._opts.model_name
        return ModelCard(id=self._opts.model_name, created=self._created, root=root, max_model_len=info.max_model_len)

    async def models(self) -> ModelList:
        return ModelList(data=[await self.model_card()])

    async def max_model_len(self) -> int:
        return (await self._client.info()).max_model_len

    async def completions(self, raw: bytes) -> Reply:
        with_release = self._admit()
        try:
            req: CompletionRequest = parse_request(CompletionRequest, raw)
            self._checks.completion(req, await self.max_model_len())  # before tokenizing
            prompts = self._prompts.completion(req.prompt)
            return await self._run(req, prompts, request_grammar(req, self._opts.limits), with_release)
        except BaseException:
            with_release()
            raise

    async def chat(self, raw: bytes) -> Reply:
        with_release = self._admit()
        try:
            req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
            self._checks.chat(req, await self.max_model_len())  # before templating
            prompts = [self._chat.prompt(req)]
            grammar, forced = request_grammar(req, self._opts.limits), self._chat.grammar(req)
            if grammar is not None and forced is not None:
                raise bad_request("tool_choice required/named cannot be combined with an output format",
                                  param="tool_choice")  # fmt: skip
            return await self._run(req, prompts, grammar or forced, with_release)
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

    async def _plan(self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                    grammar: Any, avoid: tuple[str, ...] = (),
                    deaths: DeathRecord | None = None) -> _Run:  # fmt: skip
        chat = isinstance(req, ChatCompletionRequest)
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}{id(req) & 0xFFFF:04x}"
        total = req.n if chat else (req.best_of or req.n)  # type: ignore[union-attr]
        info = await self._client.info()
        extra_stops = self._chat.stop_token_ids if chat else ()
        streams, choices = [], []
        for p_idx, ids in enumerate(prompts):
            params = sampling_params(req, len(ids), info.max_model_len, self._opts.default_max_tokens,
                                     grammar, extra_stops)  # fmt: skip
            request = RoutedRequest(
                token_ids=ids, request_id=f"{base_id}-{p_idx}", max_new_tokens=params.max_tokens * total,
                params=params, sibling_params=tuple(sibling_params(params, k) for k in range(1, total)),
                avoid=avoid,
            )  # fmt: skip
            streams.append(PromptStream(p_idx, request))
            for k, cid in enumerate(request.choice_ids):
                text = StopTextStream(self._tok, list(params.stop), context_ids=ids,
                                      skip_special_tokens=req.skip_special_tokens,
                                      include_stop=req.include_stop_str_in_output,
                                      min_tokens=req.min_tokens)  # fmt: skip
                parser = self._chat.parser(req) if isinstance(req, ChatCompletionRequest) else None
                choices.append(ChoiceState(p_idx * total + k, p_idx, cid, text, parser))
        echo = bool(getattr(req, "echo", False))
        shape = Shape(
            logprobs=bool(req.logprobs is not None if not chat else req.logprobs),
            echo=echo, prompt_logprobs=req.prompt_logprobs is not None,
            skip_special_tokens=req.skip_special_tokens,
        )  # fmt: skip
        builder = ResponseBuilder(self._tok, base_id, self._opts.model_name, chat, shape, prompts)
        return _Run(req, Fanout(streams), choices, builder, keep=req.n, deaths=deaths or DeathRecord())

    async def _run(self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                   grammar: Any, release: Callable[[], None]) -> Reply:  # fmt: skip
        t0 = time.monotonic()
        run = await self._plan(req, prompts, grammar)
        endpoint = "chat" if run.builder.chat else "completions"
        try:
            await self._start(run)
        except BaseException:
            await run.fanout.close_all()
            raise
        timer = RequestTimer(self.metrics, endpoint, t0)
        headers = self._headers(run)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(run, timer, include_usage, release)
            # NOTE: a generator that is never iterated (client gone before the body started)
            # never runs its `finally`; release the slot when it is collected instead.
            weakref.finalize(events, release)
            return Reply(headers, events=events)
        try:
            run = await self._collect_restarting(run, timer, prompts, grammar)
            headers = self._headers(run)
            kept = best_of(run.choices, [st.prompt_index for st in run.fanout.streams], run.keep)
            body = run.builder.final(kept, usage_of(run.choices))
            self._count_tokens(run)
            headers.update(served_headers([c.repaired_tokens for c in kept], [c.loaded_tokens for c in kept]))
            return Reply(headers, body=body)
        finally:
            timer.done()
            await run.fanout.close_all()
            release()

    async def _collect_restarting(self, run: _Run, timer: RequestTimer, prompts: list[list[int]],
                                  grammar: Any) -> _Run:  # fmt: skip
        """Collect a non-streaming answer; a worker replica lost mid-generation costs a restart
        on another replica, not the request (the client has seen nothing yet). Up to
        `PLAIN_RESTARTS` restarts, but none after a second replica's engine died running it
        (`DeathRecord`, shared with the client's resends: the 503 is the answer); the lost
        replicas rank last (`RoutedRequest.avoid`). Returns the run that answered; a restarted
        run that fails is closed here (the caller closes the first)."""
        first = run
        avoid: tuple[str, ...] = ()
        try:
            for restart in range(PLAIN_RESTARTS + 1):
                try:
                    await self._collect(run, timer)
                    return run
                except APIError as err:
                    failed = run.fanout.failed
                    if restart == PLAIN_RESTARTS or failed is None or not _lost_replica(err):
                        raise
                    cause = err.__cause__
                    assert cause is not None  # `_lost_replica`
                    if engine_died(cause) and not run.deaths.note(failed.replica):
                        log.warning("the engines of %d replicas died running %s; answering 503",
                                    len(run.deaths.replicas), failed.request.request_id)  # fmt: skip
                        raise
                await run.fanout.close_all()
                if failed.replica and failed.replica not in avoid:
                    avoid = (*avoid, failed.replica)
                log.warning("worker %s lost mid-generation of %s (%s); restarting the request",
                            failed.replica or "?", failed.request.request_id, type(cause).__name__)  # fmt: skip
                run = await self._plan(run.req, prompts, grammar, avoid, run.deaths)
                await self._start(run)
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            if run is not first:
                await run.fanout.close_all()
            raise

    def _headers(self, run: _Run) -> dict[str, str]:
        streams = run.fanout.streams
        headers = {REPLICA_HEADER: ",".join(dict.fromkeys(s.replica for s in streams))}
        headers.update(prediction_headers([_placement(s) for s in streams]))
        return headers

    async def _start(self, run: _Run) -> None:
        starts = await asyncio.gather(*(self._open(s, run.deaths) for s in run.fanout.streams))
        refused = [s for s in starts if s.refusal is not None]
        if refused:
            s = refused[0]
            if s.refusal == "invalid":
                message = s.message or "invalid request"
                param = message.split(" ", 1)[0] if message.startswith(("grammar", "prompt")) else None
                raise bad_request(message, param=param)
            raise overloaded(503, s.message or "worker unavailable", self._opts.retry_after_s)

    async def _open(self, s: PromptStream, deaths: DeathRecord) -> StreamStart:
        s.stream = self._client.stream(s.request, deaths)
        try:
            first = await s.stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "worker stream ended before it started", type="server_error") from None
        except Exception as e:  # noqa: BLE001 - translated into an HTTP status
            raise translate_worker_error(e, self._opts.retry_after_s) from e
        if not isinstance(first, StreamStart):
            raise APIError(500, f"worker sent {type(first).__name__} before StreamStart", type="server_error")
        s.start = first
        return first

    async def _deltas(self, run: _Run, timer: RequestTimer) -> AsyncIterator[tuple[ChoiceState, Any]]:
        """(choice, text piece) per worker delta, until every choice is done; a stream whose
        choices are all done is closed at once (stop strings end choices before the worker)."""
        by_id = {c.request_id: c for c in run.choices}
        try:
            async for s, delta in run.fanout.deltas():
                if delta.error:
                    raise APIError(500, f"generation failed: {delta.error}", type="server_error")
                c = by_id[delta.request_id]
                if delta.prompt_logprobs is not None:  # every choice of the prompt shows them
                    for other in run.choices:
                        if other.prompt_index == c.prompt_index and other.prompt_logprobs is None:
                            other.prompt_logprobs = delta.prompt_logprobs
                timer.tokens(len(delta.token_ids))
                piece = c.consume(delta)
                yield c, (piece, delta)
                mine = [x for x in run.choices if x.prompt_index == s.prompt_index]
                if all(x.done for x in mine):
                    await run.fanout.close(s)
                if all(x.done for x in run.choices):
                    return
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise translate_worker_error(e, self._opts.retry_after_s) from e

    async def _collect(self, run: _Run, timer: RequestTimer) -> None:
        async for c, (piece, delta) in self._deltas(run, timer):
            if c.parser is not None:
                c.parser.feed(piece.text, delta.token_ids)
                if c.done:
                    c.parser.finish()

    async def _events(self, run: _Run, timer: RequestTimer, include_usage: bool,
                      release: Callable[[], None]) -> AsyncIterator[str]:  # fmt: skip
        builder, started = run.builder, set()
        try:
            if builder.chat:  # OpenAI opens each chat choice with a role-only delta
                for c in run.choices:
                    yield from_model(builder.first_chunk(c))
            async for c, (piece, delta) in self._deltas(run, timer):
                chunk: BaseModel | None
                if c.parser is not None:
                    chat_piece = c.parser.feed(piece.text, delta.token_ids)
                    if c.done:
                        tail = c.parser.finish()
                        chat_piece.content += tail.content
                        chat_piece.reasoning += tail.reasoning
                        chat_piece.tool_calls += tail.tool_calls
                    chunk = builder.chat_chunk(c, chat_piece, delta, final=c.done)
                else:
                    first = c.index not in started
                    chunk = builder.completion_chunk(c, piece.text, delta, first=first, final=c.done)
                    if chunk is not None:
                        started.add(c.index)
                if chunk is not None:
                    yield from_model(chunk)
            if include_usage:
                yield from_model(builder.usage_chunk(usage_of(run.choices)))
            self._count_tokens(run)
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            err = e if isinstance(e, APIError) else translate_worker_error(e, self._opts.retry_after_s)
            yield sse(err.body())
        finally:
            timer.done()
            await run.fanout.close_all()
            release()

    def _count_tokens(self, run: _Run) -> None:
        """Token counters, and the router's prediction against what the worker really reused."""
        cached = {c.request_id: c.cached_tokens for c in run.choices}
        for s in run.fanout.streams:
            # Before the client has its answer: tells the routers in this process that the
            # request is done and its cache events published (router/routing_record.py).
            routing_record.note_finished(s.request.request_id)
            placed = _placement(s)
            if placed is not None and placed.predicted_cached_tokens is not None:
                routing_metrics().observe_outcome(
                    placed.policy, placed.predicted_cached_tokens, cached.get(s.request.request_id, 0)
                )
        u = usage_of(run.choices)
        self.metrics.prompt_tokens.inc(u.prompt_tokens)
        self.metrics.cached_tokens.inc(u.prompt_tokens_details.cached_tokens)
        self.metrics.count_repairs([c.repaired_tokens for c in run.choices])
        self.metrics.count_loads([c.loaded_tokens for c in run.choices])
        self.metrics.completion_tokens.inc(u.completion_tokens)

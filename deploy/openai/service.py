"""The OpenAI endpoints' logic, independent of FastAPI and Ray.

A request goes: strict parse, checks, tokenize (chat format for chat), all on a pool thread
(`deploy/openai/offload.py`; on the loop for a body of a few KB) -> `SamplingParams` -> admission by its work (sequences and tokens,
`deploy/openai/admission.py`: 429 / 400) -> one worker stream per prompt carrying all of its
choices (`n`, or `best_of`; they share one prefill on one replica) -> the first item of each
stream (`StreamStart`: replica id, or a refusal -> 400/503) -> a JSON body or SSE events, each
delta rendered on the loop when small, else on the pool. Leaving early (client gone, the
request's deadline, a client that stops reading) closes the worker streams, which aborts the
requests on the workers and frees their KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster.messages import RoutedRequest, StreamStart
from core.outputs import StreamDelta
from deploy.metrics import IngressMetrics
from deploy.openai.admission import Admission, AdmissionLimits, Ticket, Work
from deploy.openai.bodies import ModelCard, ModelList
from deploy.openai.chat_format import ChatFormat, TemplateChat
from deploy.openai.checks import RequestChecks, sampling_params, sibling_params
from deploy.openai.choices import ChoiceState, best_of, usage_of
from deploy.openai.detokenize import StopTextStream
from deploy.openai.errors import generation_failed, public
from deploy.openai.fanout import Fanout, PromptStream, before_deadline
from deploy.openai.headers import REPLICA_HEADER, prediction_headers, served_headers
from deploy.openai.limits import RequestLimits
from deploy.openai.offload import SMALL_BODY, SMALL_DELTA, CpuPool
from deploy.openai.prepare import Prepared, Preparer
from deploy.openai.prompts import PromptBuilder
from deploy.openai.responses import ResponseBuilder, Shape
from deploy.openai.schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    overloaded,
)
from deploy.openai.streaming import SSE_DONE, RequestTimer, from_model, sse, translate_worker_error
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
T = TypeVar("T")

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
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)  # in flight here; more: 429
    retry_after_s: int = 1
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    limits: RequestLimits = RequestLimits()  # what one request may hold (README "Limits")
    request_timeout_s: float | None = None  # a generation request's deadline from its arrival
    cpu_threads: int = 4  # the pool for per-request CPU work (`deploy/openai/offload.py`)


@dataclass(frozen=True)
class Reply:
    """What an endpoint produced: a JSON body or an SSE event stream, plus headers."""

    headers: dict[str, str]
    body: bytes | None = None
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

    def work(self) -> Work:
        """What this request holds while it runs: sequences, and tokens (each prompt once, and
        max_tokens for each of its choices)."""
        streams = [s.request for s in self.fanout.streams]
        tokens = sum(len(r.token_ids) + r.max_new_tokens for r in streams)
        best = getattr(self.req, "best_of", None)
        chat_limit = getattr(self.req, "max_completion_tokens", None) is not None
        return Work(len(self.choices), tokens, "best_of" if best and best > self.req.n else "n",
                    "max_completion_tokens" if chat_limit else "max_tokens")  # fmt: skip


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
        self._chat = chat_format or TemplateChat(tokenizer, "")
        checks = RequestChecks(options.model_name, len(tokenizer), options.limits)
        self._prepare = Preparer(checks, PromptBuilder(tokenizer), self._chat, options.limits)
        self.admission = Admission(options.admission, options.retry_after_s, self.metrics)
        self.pool = CpuPool(options.cpu_threads)
        # NOTE: a fast tokenizer's first call may reset the truncation/padding a tokenizer.json
        # set (a write to the Rust object); done here, before the pool's threads share it, so
        # they only ever read it ("Already borrowed" otherwise).
        tokenizer("warm-up")
        self._created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def limits(self) -> RequestLimits:
        return self._opts.limits

    # -- endpoints -------------------------------------------------------------------------

    async def replica_stats(self) -> ReplicaSnapshot:
        return await self._client.replica_stats()

    async def model_card(self) -> ModelCard:
        """`root` is the served name too: a client reading it learns no path of this server."""
        info = await self._client.info()
        name = self._opts.model_name
        return ModelCard(id=name, created=self._created, root=name, max_model_len=info.max_model_len)

    async def models(self) -> ModelList:
        return ModelList(data=[await self.model_card()])

    async def max_model_len(self) -> int:
        return (await self._client.info()).max_model_len

    async def completions(self, raw: bytes, rid: str = "") -> Reply:
        """`rid`: the request id errors name (`deploy/openai/errors.py`)."""
        return await self._generate(self._prepare.completion, raw, rid)

    async def chat(self, raw: bytes, rid: str = "") -> Reply:
        return await self._generate(self._prepare.chat, raw, rid)

    async def _generate(self, prepare: Callable[[bytes, int], Prepared], raw: bytes, rid: str) -> Reply:
        arrived = asyncio.get_running_loop().time()
        self.admission.check_room()  # before any work on the body
        max_model_len = await self.max_model_len()
        if len(raw) <= SMALL_BODY:
            ready = prepare(raw, max_model_len)  # cheaper than the hop to a thread
        else:
            ready = await self.pool.run(prepare, raw, max_model_len)
        deadline = None if self._opts.request_timeout_s is None else arrived + self._opts.request_timeout_s
        return await self._run(ready.req, ready.prompts, ready.grammar, rid, deadline)

    @property
    def inflight(self) -> int:
        """Generation requests in flight (admitted, not yet answered or closed)."""
        return self.admission.requests

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
                   grammar: Any, rid: str, deadline: float | None) -> Reply:  # fmt: skip
        t0 = time.monotonic()
        run = await self._plan(req, prompts, grammar)
        ticket = self.admission.admit(run.work())
        endpoint = "chat" if run.builder.chat else "completions"
        try:
            await before_deadline(deadline, self._start(run))
        except BaseException:
            await run.fanout.close_all()
            ticket.release()
            raise
        timer = RequestTimer(self.metrics, endpoint, t0)
        headers = self._headers(run)
        if req.stream:
            run.fanout.deadline = deadline  # each wait for a delta; the writes: WriteTimeout
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(run, timer, include_usage, ticket, rid)
            # NOTE: a generator that is never iterated (client gone before the body started)
            # never runs its `finally`; release the share when it is collected instead.
            weakref.finalize(events, ticket.release)
            return Reply(headers, events=events)
        try:
            run = await before_deadline(deadline, self._collect_restarting(run, timer, prompts, grammar))
            headers = self._headers(run)
            body, served = await self.pool.run(self._final_body, run)
            self._count_tokens(run)
            return Reply({**headers, **served}, body=body)
        finally:
            timer.done()
            await run.fanout.close_all()
            ticket.release()

    @staticmethod
    def _final_body(run: _Run) -> tuple[bytes, dict[str, str]]:
        """The JSON body of a non-streamed answer, and its repaired- and loaded-tokens headers
        (pool thread)."""
        kept = best_of(run.choices, [st.prompt_index for st in run.fanout.streams], run.keep)
        body = run.builder.final(kept, usage_of(run.choices)).model_dump_json(exclude_none=True)
        return body.encode(), served_headers([c.repaired_tokens for c in kept], [c.loaded_tokens for c in kept])

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

    async def _deltas(self, run: _Run, timer: RequestTimer,
                      step: Callable[[ChoiceState, StreamDelta], T]) -> AsyncIterator[T]:  # fmt: skip
        """`step(choice, delta)` per worker delta (on the loop when the delta is small, else on
        the pool), until every choice is done; a stream whose choices are all done is closed at
        once (stop strings end choices before the worker)."""
        by_id = {c.request_id: c for c in run.choices}
        echo = run.builder.shape.echo
        try:
            async for s, delta in run.fanout.deltas():
                if delta.error:
                    raise generation_failed(delta.error)
                c = by_id[delta.request_id]
                if delta.prompt_logprobs is not None:  # every choice of the prompt shows them
                    for other in run.choices:
                        if other.prompt_index == c.prompt_index and other.prompt_logprobs is None:
                            other.prompt_logprobs = delta.prompt_logprobs
                timer.tokens(len(delta.token_ids))
                small = len(delta.token_ids) <= SMALL_DELTA and delta.prompt_logprobs is None
                if small and not (echo and not c.token_ids):  # the first chunk echoes the prompt
                    yield step(c, delta)
                else:
                    yield await self.pool.run(step, c, delta)
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
        async for _ in self._deltas(run, timer, run.builder.fold):
            pass

    async def _events(self, run: _Run, timer: RequestTimer, include_usage: bool, ticket: Ticket,
                      rid: str) -> AsyncIterator[str]:  # fmt: skip
        builder = run.builder
        try:
            if builder.chat:  # OpenAI opens each chat choice with a role-only delta
                for c in run.choices:
                    yield from_model(builder.first_chunk(c))
            async for event in self._deltas(run, timer, builder.event):
                if event is not None:
                    yield event
            if include_usage:
                yield from_model(builder.usage_chunk(usage_of(run.choices)))
            self._count_tokens(run)
            # Done: its share is back before the response ends (the rest of the cleanup, below,
            # runs after the client has the whole response: `ingress._ClosingStream`).
            ticket.release()
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            err = e if isinstance(e, APIError) else translate_worker_error(e, self._opts.retry_after_s)
            if not isinstance(e, APIError):
                err.__cause__ = e
            yield sse(public(err, rid).body())
        finally:
            timer.done()
            await run.fanout.close_all()
            ticket.release()

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

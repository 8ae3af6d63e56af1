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
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from deploy.choices import ChoiceState, merged, usage_of
from deploy.detokenize import StopTextStream
from deploy.metrics import IngressMetrics
from deploy.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    overloaded,
    parse_request,
)
from deploy.prompts import PromptBuilder
from deploy.responses import ResponseBuilder
from deploy.worker_client import ReplicaSnapshot, WorkerClient
from deploy.worker_protocol import StreamStart
from worker.sampling_params import SamplingParams

REPLICA_HEADER = "x-swaserve-replica"
PREDICTED_HEADER = "x-swaserve-predicted-cached-tokens"


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


RequestFactory = Callable[[str, list[int], SamplingParams], Any]


class OpenAIService:
    def __init__(
        self,
        tokenizer: Any,
        client: WorkerClient,
        options: ServiceOptions,
        make_request: RequestFactory,
        metrics: IngressMetrics | None = None,
    ) -> None:
        self._tok = tokenizer
        self._client = client
        self._opts = options
        self._make_request = make_request
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
            self._check_common(req)
            self._check_completion_only(req)
            prompts = self._prompts.completion(req.prompt)
            return await self._run(req, prompts, chat=False, release=with_release)
        except BaseException:
            with_release()
            raise

    async def chat(self, raw: bytes) -> Reply:
        with_release = self._admit()
        try:
            req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
            self._check_common(req)
            self._check_chat_only(req)
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

    # -- validation --------------------------------------------------------------------------

    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self._opts.model_name:
            raise APIError(
                404, f"The model '{req.model}' does not exist; this server serves "
                f"'{self._opts.model_name}' (see GET /v1/models)", param="model", code="model_not_found",
            )  # fmt: skip
        if req.presence_penalty or req.frequency_penalty:
            name = "presence_penalty" if req.presence_penalty else "frequency_penalty"
            raise bad_request(f"{name} is not supported; send 0 or omit it", param=name)
        if req.logit_bias:
            raise bad_request("logit_bias is not supported; omit it", param="logit_bias")
        if len(req.stop_list()) > 4:
            raise bad_request("stop takes at most 4 strings", param="stop")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")

    def _check_completion_only(self, req: CompletionRequest) -> None:
        if req.echo:
            raise bad_request("echo is not supported; send false or omit it", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported; omit it", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking)", param="best_of")

    def _check_chat_only(self, req: ChatCompletionRequest) -> None:
        if req.tools:
            raise bad_request("tools are not supported; omit them", param="tools")
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice must be 'none' or omitted", param="tool_choice")
        if req.response_format and req.response_format.get("type") != "text":
            raise bad_request("response_format must be {'type': 'text'}", param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")

    async def _sampling(
        self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int, chat: bool
    ) -> SamplingParams:
        info = await self._client.info()
        room = info.max_model_len - prompt_len
        pname = "messages" if chat else "prompt"
        if room < 1:
            raise bad_request(
                f"prompt has {prompt_len} tokens; this model's context is {info.max_model_len} "
                f"tokens, so at most {info.max_model_len - 1} prompt tokens fit",
                param=pname, code="context_length_exceeded",
            )  # fmt: skip
        if chat:
            max_tokens = req.max_completion_tokens or req.max_tokens or room  # type: ignore[union-attr]
            logprobs = (req.top_logprobs or 0) if req.logprobs else None  # type: ignore[union-attr]
        else:
            max_tokens = req.max_tokens or self._opts.default_max_tokens
            logprobs = req.logprobs  # type: ignore[assignment]
        if max_tokens > room:
            raise bad_request(
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"context of {info.max_model_len} tokens; ask for at most {room}",
                param="max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens",  # type: ignore[union-attr]
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop=tuple(req.stop_list()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
        return params

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
            params = await self._sampling(req, len(ids), chat)
            for k in range(req.n):
                seeded = params if params.seed is None or k == 0 else dataclasses.replace(params, seed=params.seed + k)
                index = p_idx * req.n + k
                request = self._make_request(f"{base_id}-{index}", ids, seeded)
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
        predicted = [getattr(c.request, "predicted_cached_tokens", None) for c in choices]
        if any(p is not None for p in predicted):
            headers[PREDICTED_HEADER] = ",".join(str(p) for p in predicted)
        timer = _Timer(self.metrics, endpoint, t0)
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
        c.replica = first.replica_id
        return first

    async def _collect(self, choices: list[ChoiceState], timer: _Timer) -> None:
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
        timer: _Timer,
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
        u = usage_of(choices)
        self.metrics.prompt_tokens.inc(u.prompt_tokens)
        self.metrics.cached_tokens.inc(u.prompt_tokens_details.cached_tokens)
        self.metrics.completion_tokens.inc(u.completion_tokens)


class _Timer:
    """TTFT, inter-token latency and end-to-end latency of one HTTP request."""

    def __init__(self, metrics: IngressMetrics, endpoint: str, t0: float) -> None:
        self._m, self._endpoint, self._t0 = metrics, endpoint, t0
        self._last: float | None = None
        self._closed = False

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.labels(self._endpoint).observe(now - self._t0)
        else:
            gap = (now - self._last) / n  # a coalesced delta carries n tokens
            for _ in range(n):
                self._m.itl.labels(self._endpoint).observe(gap)
        self._last = now

    def done(self) -> None:
        if not self._closed:
            self._closed = True
            self._m.latency.labels(self._endpoint).observe(time.monotonic() - self._t0)


def translate_worker_error(e: BaseException, retry_after_s: int) -> APIError:
    """Map what a worker call can raise to an HTTP status (overload/unavailable -> 503)."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(e, BackPressureError):
        return overloaded(503, "worker queues are full; retry later", retry_after_s)
    if isinstance(e, DeploymentUnavailableError):
        return overloaded(503, "no worker replica is available; retry later", retry_after_s)
    name = type(e).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "ReplicaUnavailable" in name:
        return overloaded(503, f"a worker replica went away ({name}); retry", retry_after_s)
    return APIError(500, f"internal error while generating: {name}: {e}", type="server_error")


async def _close_all(choices: list[ChoiceState]) -> None:
    for c in choices:
        try:
            await c.close()
        except Exception:  # noqa: BLE001, S110 - closing must not mask the original outcome
            pass


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def from_model(m: BaseModel) -> str:
    return f"data: {m.model_dump_json(exclude_none=True)}\n\n"

"""The worker deployment: one engine per Ray Serve replica (`EngineProcess`, its own child
process, docs/design.md §20; `AsyncEngine`, a thread of the replica, under tensor parallelism).

The class is plain Python (no Serve decorator) so tests drive it in-process with a fake engine;
`deploy.app` wraps it with `serve.deployment(...)`. Serve calls, besides `generate`:

- `record_routing_stats()` every `request_routing_stats_period_s` (the controller): queue sizes
  and both pools' numbers, for the routers; the same sample goes to the deployment's index actor,
  where the ingress reads every replica's for `/metrics` and `/health` (`cluster.replica_stats`;
  a request's first tokens and its end send one too, so a scrape right after sees them);
- `check_health()` every `health_check_period_s`: raises when the engine is stuck or shut down,
  or when a tensor-parallel rank is gone (`EngineClient.error`, docs/design.md §17.4);
- `__del__` after Serve's graceful drain (no new requests are routed here and ongoing requests
  had up to `graceful_shutdown_timeout_s` to finish): aborts stragglers, stops the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.messages import (
    EngineDiedError,
    RoutedRequest,
    StatsDict,
    StreamStart,
    WorkerInfo,
    WorkerUnavailableError,
    routing_stats,
)
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from deploy.metrics import flatten_stats
from worker.config import EngineConfig
from worker.engine.protocols import EngineClient
from worker.errors import EngineGoneError

if TYPE_CHECKING:
    from ray.serve.context import ReplicaContext

    from deploy.replica.events import CacheEventPump

_DeltaQueue = asyncio.Queue[tuple[str, StreamDelta | BaseException | None]]

log = logging.getLogger("swaserve.worker")

EngineFactory = Callable[[EngineConfig], EngineClient]


@dataclass(frozen=True)
class WorkerOptions:
    stall_timeout_s: float = 120.0  # pending work but no engine step for this long -> unhealthy
    publish_events: bool = True  # cache events to the index actor (only inside a Serve replica)
    event_interval_s: float = 0.25  # background flush period of cache events
    engine_process: bool = True  # step the engine in a child process (one rank; docs §20)
    engine_niceness: int | None = None  # that process's niceness (None: the replica's)


def _default_engine(
    config: EngineConfig, own_process: bool = True, niceness: int | None = None
) -> EngineClient:
    """The engine of a replica: in a child process (`own_process`, one rank) or on a thread of
    the replica's process (tensor parallelism: the ranks are Ray actors the replica starts)."""
    if config.tensor_parallel_size > 1 and _replica_context() is not None:
        from deploy.replica.ranks import RayRankLauncher  # ranks in the replica's placement group
        from worker.hosts.async_engine import AsyncEngine

        return AsyncEngine(config, launcher=RayRankLauncher(current_replica_id()))
    if own_process and config.tensor_parallel_size == 1:
        from worker.hosts.engine_process import EngineProcess

        return EngineProcess(config, niceness=niceness)
    from worker.hosts.async_engine import AsyncEngine  # heavy (torch); only inside the replica

    return AsyncEngine(config)


def _replica_context() -> ReplicaContext | None:
    try:
        from ray import serve

        return serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


def current_replica_id() -> str:
    """Serve's short replica id inside a replica; `local-<pid>` outside Serve (tests)."""
    ctx = _replica_context()
    return ctx.replica_id.unique_id if ctx is not None else f"local-{os.getpid()}"


class WorkerDeployment:
    def __init__(
        self,
        engine_config: EngineConfig,
        options: WorkerOptions | None = None,
        engine_factory: EngineFactory | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id or current_replica_id()
        self._options = options or WorkerOptions()
        self._engine = (
            engine_factory(engine_config)
            if engine_factory is not None
            else _default_engine(
                engine_config, self._options.engine_process, self._options.engine_niceness
            )
        )
        self._events = self._event_pump()
        self._inflight: set[str] = set()
        self._draining = False
        self._stopped = False
        self._progress = (0, time.monotonic())  # (engine steps, when they last changed)

    def _event_pump(self) -> CacheEventPump | None:
        ctx = _replica_context()
        if not self._options.publish_events or ctx is None:
            return None
        from deploy.replica.events import CacheEventPump

        return CacheEventPump(
            self._engine,
            self.replica_id,
            ctx.app_name,
            ctx.deployment,
            self._options.event_interval_s,
        )

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self, request: RoutedRequest
    ) -> AsyncGenerator[StreamStart | StreamDelta, None]:
        """Stream one prompt: a `StreamStart`, then coalesced `StreamDelta`s until every choice
        finished (each delta's `request_id` names its choice, `RoutedRequest.choice_ids`).

        Cancelling the caller (client disconnect, stop string at the ingress) cancels this
        generator; the pump tasks are cancelled with it and the engine aborts the requests.
        """
        token_ids = list(request.token_ids)
        params = request.params if request.params is not None else SamplingParams()
        choices = list(zip(request.choice_ids, (params, *request.sibling_params)))
        refusal = await self._refusal(token_ids, params)
        if refusal is not None:
            yield refusal
            return
        if self._events is not None:
            await self._events.ensure_started()
        yield StreamStart(self.replica_id)
        queue: _DeltaQueue = asyncio.Queue()  # (choice id, delta | error | None: ended)
        first = choices[0][0]
        pumps = [
            asyncio.create_task(
                self._pump(token_ids, p, cid, queue, None if cid == first else first)
            )
            for cid, p in choices
        ]
        open_ids = {cid for cid, _ in choices}
        self._inflight.update(open_ids)
        try:
            reported = False
            while open_ids:
                for delta in await self._next_deltas(queue):
                    if delta.finished:
                        open_ids.discard(delta.request_id)
                    if not open_ids and self._events is not None:
                        # The cache these requests leave behind reaches the index before the
                        # client hears back, so a follow-up is routed with it.
                        await self._events.flush()
                    if not reported or not open_ids:
                        self._report_stats(register=False)
                        reported = True
                    yield delta
        finally:
            self._inflight.difference_update(cid for cid, _ in choices)
            live = [p for p in pumps if not p.done()]
            for p in live:
                p.cancel()
            await asyncio.gather(*live, return_exceptions=True)

    async def _next_deltas(self, queue: _DeltaQueue) -> list[StreamDelta]:
        """Everything queued since the last call, merged per choice (fewer Ray stream items
        when the consumer is slower than the engine). Raises what the engine raised, or
        `WorkerUnavailableError` when a request was aborted here rather than by the caller
        (a caller that cancels is gone and never sees this): that is shutdown."""
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        errors = [item for _, item in batch if isinstance(item, BaseException)]
        if errors:
            raise errors[0]
        per_choice: dict[str, list[StreamDelta]] = {}
        for cid, item in batch:
            if isinstance(item, StreamDelta):
                per_choice.setdefault(cid, []).append(item)
        merged = {cid: merge_deltas(ds) for cid, ds in per_choice.items()}
        for cid, item in batch:
            delta = merged.get(cid)
            ended_early = item is None and not (delta and delta.finished)
            if ended_early or (delta and delta.finish_reason == "abort" and not delta.error):
                raise WorkerUnavailableError(
                    f"request {cid} was aborted on worker {self.replica_id}; retry"
                )
        return list(merged.values())

    async def _pump(
        self,
        token_ids: list[int],
        params: SamplingParams,
        rid: str,
        queue: _DeltaQueue,
        follows: str | None,
    ) -> None:
        gen = self._engine.generate(token_ids, params, rid, follows)
        try:
            async for delta in gen:
                queue.put_nowait((rid, delta))
        except EngineGoneError as e:
            queue.put_nowait((rid, self._engine_gone(rid, e)))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer, raised there
            failed = self._engine.error is not None  # it died before this request reached it
            refused = WorkerUnavailableError(f"worker {self.replica_id}: its engine failed; retry")
            queue.put_nowait((rid, refused if failed else e))
        finally:
            queue.put_nowait((rid, None))
            await gen.aclose()

    def _engine_gone(self, rid: str, e: EngineGoneError) -> WorkerUnavailableError:
        """The engine ended under request `rid`: stopped by a shutdown (not the request's
        doing), or died running it — maybe because of it, so the ingress sends it elsewhere at
        most once more (`EngineDiedError`). The engine's reason stays in this replica's log."""
        if self._draining:
            return WorkerUnavailableError(f"worker {self.replica_id} is shutting down; retry")
        log.warning("worker %s: the engine died while running %s: %s", self.replica_id, rid, e)
        return EngineDiedError(f"worker {self.replica_id}: its engine died while running the request")

    async def _refusal(self, token_ids: list[int], params: SamplingParams) -> StreamStart | None:
        if self._draining:
            return StreamStart(
                self.replica_id, "unavailable", "worker replica is shutting down; retry"
            )
        if self._engine.error is not None:  # Serve replaces us at the next health check
            return StreamStart(self.replica_id, "unavailable", "worker engine failed; retry")
        try:
            # Off the event loop: checking a grammar compiles it, and an engine in its own
            # process answers over its connection.
            await asyncio.to_thread(self._engine.validate, token_ids, params)
        except ValueError as e:
            return StreamStart(self.replica_id, "invalid", str(e))
        except Exception:
            if self._engine.error is None:
                raise
            return StreamStart(self.replica_id, "unavailable", "worker engine failed; retry")
        return None

    # -- control plane ---------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            replica_id=self.replica_id,
            max_model_len=int(self._engine.max_model_len),
            model_dir=str(self._engine.model_dir),
            page_size=int(self._engine.config.page_size),
        )

    async def record_routing_stats(self) -> StatsDict:
        """`cluster.messages.routing_stats` (the router's contract) plus every engine number for
        `/metrics`; all values are flat numbers except `worker_id`. Serve calls this on RUNNING
        replicas only, so it also (re)registers the replica with the index actor's stats board."""
        if self._events is not None:
            try:
                await self._events.ensure_started()
            except Exception:  # noqa: BLE001 - the routers' stats must not depend on the index actor
                log.exception("registering with the cache index failed; retrying next time")
        return self._report_stats(register=True)

    def _report_stats(self, *, register: bool) -> StatsDict:
        sample = self._stats_sample()
        if self._events is not None:
            self._events.report_stats(sample, register=register)
        return sample

    def _stats_sample(self) -> StatsDict:
        s = self._engine.stats()  # plain reads: no wait for the engine's step
        out = routing_stats(s, self.replica_id, time.time())
        out.update(flatten_stats(s))
        out["inflight"] = float(len(self._inflight))
        out["draining"] = 1.0 if self._draining else 0.0
        out["pid"] = float(
            os.getpid()
        )  # which process serves this replica (operators, fault tests)
        return out

    def check_health(self) -> None:
        if self._draining:
            return  # Serve is stopping us; do not get replaced mid-drain
        error = self._engine.error
        if error is not None:
            raise RuntimeError(f"engine failed (step thread or a tensor-parallel rank): {error!r}")
        s = self._engine.stats()
        steps, since = self._progress
        now = time.monotonic()
        if s.steps != steps or (s.waiting + s.running) == 0:
            self._progress = (s.steps, now)
        elif now - since > self._options.stall_timeout_s:
            raise RuntimeError(
                f"engine made no step in {now - since:.0f}s with {s.waiting} waiting and "
                f"{s.running} running requests (stall_timeout_s={self._options.stall_timeout_s})"
            )

    async def flush_cache(self) -> bool:
        """Empty the radix cache when idle (False while requests run); for tests and benches."""
        flushed = bool(await asyncio.to_thread(self._engine.flush_cache))
        if self._events is not None:
            await self._events.flush()
        return flushed

    async def check_integrity(self) -> None:
        # Both run on the engine's step thread between steps; wait for them off the event loop.
        await asyncio.to_thread(self._engine.check_integrity)

    def shutdown(self) -> None:
        """Stop taking requests, abort what is left, stop the engine (idempotent)."""
        if self._stopped:
            return
        self._draining = self._stopped = True
        for rid in list(self._inflight):
            self._engine.abort(rid)
        log.info("worker %s shutting down (%d aborted)", self.replica_id, len(self._inflight))
        if self._events is not None:
            self._events.close()
        self._engine.shutdown()

    def __del__(self) -> None:
        # Serve calls this after its graceful drain; also runs when a test drops the object.
        if getattr(self, "_engine", None) is not None:
            self.shutdown()


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Coalesce consecutive deltas of one request into one (fewer Ray stream items under load)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    prompt_logprobs = next(
        (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None
    )
    return dataclasses.replace(
        last, token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )

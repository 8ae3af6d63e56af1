"""`AsyncEngine`: an `Engine` stepped on a background thread, streaming to asyncio consumers.

One per worker replica. Requests enter through the engine's thread-safe inbox; the step thread
pushes each `StreamDelta` into the consumer's asyncio queue with `call_soon_threadsafe`.
Operations that touch engine state (integrity checks, flush, cache events, snapshots) run on
the step thread between steps, so they never race a step.

A step that raises is the engine's death (what one request alone breaks ends that request
inside the step: docs/design.md §4.1): every open stream raises `EngineGoneError` — those still
in the inbox too, which no step will ever answer — and every pending or later call fails at
once instead of waiting for a step thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TypeVar

from core.events import CacheEvent, PageState
from core.outputs import EngineStats, StreamDelta
from core.reuse import TierCosts
from core.sampling_params import SamplingParams
from worker.assembly.parts import EngineParts
from worker.assembly.ranks import RankLauncher
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.errors import EngineGoneError
from worker.hosts.streams import DeltaQueue, StreamingHost

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05  # how long the idle step thread sleeps before looking at the inbox again


class AsyncEngine(StreamingHost):
    def __init__(
        self,
        config: EngineConfig,
        parts: EngineParts | None = None,
        launcher: RankLauncher | None = None,
    ) -> None:
        self.engine = Engine(config, parts, launcher)
        self.config = config
        self.spec = self.engine.spec
        self.max_model_len = self.engine.max_model_len
        self.model_dir: Path | None = self.engine.parts.model_dir
        self.window: int | None = self.spec.window if self.spec.has_swa else None
        self.swa_layers = len(self.spec.swa_layer_ids)
        self.tier_costs: TierCosts | None = self.engine.tier_costs
        self._wake = threading.Event()
        self._stop = threading.Event()
        # (run it, fail it): closures over each call's typed future, run on the step thread
        self._calls: list[tuple[Callable[[], None], Callable[[BaseException], None]]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]] = {}
        self._lock = threading.Lock()  # calls, streams, error: the step thread's death is atomic
        self._error: BaseException | None = None
        self._stopped = False  # the step thread has ended (shut down, or died: `_error`)
        self._thread = threading.Thread(target=self._loop, name="swaserve-engine", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The step thread's fatal error, or a tensor-parallel rank that is gone."""
        if self._error is not None:
            return self._error
        failure = self.engine.rank_failure()
        return RuntimeError(failure) if failure is not None else None

    # ---- requests -------------------------------------------------------------------------------
    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        follows: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream the request's deltas; stopping the iteration (or cancelling) aborts it.
        `follows`: another choice of the same prompt, already added (see `Engine.add_request`).
        A request the engine refuses raises its `ValueError` before any delta (from the add)."""

        async def start(deltas: DeltaQueue) -> None:
            loop = asyncio.get_running_loop()

            def sink(delta: StreamDelta) -> None:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)

            add = functools.partial(
                self.engine.add_request, token_ids, params, request_id, sink, follows
            )
            # A grammar compiles in add_request: off the event loop (and off the step thread).
            if params.grammar is None:
                add()
            else:
                await asyncio.to_thread(add)
            self._wake.set()

        return self._relay(request_id, start)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    # ---- state, run on the step thread ----------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.engine.stats()  # the snapshot the step thread published: safe from any thread

    def check_integrity(self) -> None:
        self.call(self.engine.check_integrity)

    def flush_cache(self) -> bool:
        return self.call(self.engine.flush_cache)

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.call(self.engine.drain_cache_events)

    def cache_snapshot(self) -> dict[int, PageState]:
        return self.call(self.engine.cache_snapshot)

    def drain_and_snapshot(self) -> tuple[list[CacheEvent], dict[int, PageState]]:
        """Pending events and the snapshot they lead to, taken atomically."""
        return self.call(lambda: (self.engine.drain_cache_events(), self.engine.cache_snapshot()))

    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run `fn` on the step thread between steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        with self._lock:  # with `_die`'s: a call is either failed by it or never queued
            self._check_alive()
            self._calls.append((run, fut.set_exception))
        self._wake.set()
        return fut.result(timeout=timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        # NOTE: a step thread still inside a collective must not race the stop message.
        self.engine.close(force=self._thread.is_alive())

    # ---- the step thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_calls()
                if self.engine.has_work():
                    self.engine.step()
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - surfaced to every caller
            logger.exception("engine step thread died")
            self._die(exc)
            return
        self._die(None)  # shut down: calls still queued are never run

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for run, _ in calls:
            run()

    def _die(self, exc: BaseException | None) -> None:
        """The step thread ends (`exc`: it raised): fail every queued call and every open
        stream; nothing is queued after this (`_check_alive` under the same lock)."""
        with self._lock:
            self._error = exc
            self._stopped = True
            calls, self._calls = self._calls, []
            streams, self._streams = self._streams, {}
        why = "the engine is shut down" if exc is None else f"engine stopped: {exc!r}"
        for _, fail in calls:
            fail(RuntimeError(why))
        for loop, q in streams.values():
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, EngineGoneError(why))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an internal error: {self.error!r}")
        if self._stopped:
            raise RuntimeError("the engine is shut down")

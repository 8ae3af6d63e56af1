"""`EngineProcess`: the engine stepped in a child process of the replica (docs/design.md §20).

`AsyncEngine` steps the engine on a thread of the replica's own process, where Ray's and Serve's
threads run too: every streamed item, metrics push and health check is Python that holds the GIL,
and each time the step thread comes back from a torch op it may wait for that. Measured on one
CPU thread (46M Gemma-3, batch 1): a background thread holding the GIL ~10 % of the time made
each decode step ~10 % slower, and a served replica's steps were ~30 % slower than offline ones.
`EngineProcess` is the same `EngineClient`, with the engine in a process of its own (vLLM's
engine core does the same): the child runs the step loop and sends one message per step (every
request's deltas, the new stats snapshot and the cache events the step queued); the replica's
process only routes them. The events ride with the deltas so that publishing a finished
request's cache (which must reach the router before the client hears back) waits for nothing:
fetching them with a call instead waited for the step in flight, and with many requests ending
at once those waits queued one behind another (seconds at concurrency 32).

    replica process                           child (python -m worker.hosts.engine_process)
    generate/abort/calls ──send──▶            control thread: adds (a refused one answered
    reader thread ◀──recv── (step: deltas, stats,     at once), aborts → engine inbox, calls queued
      events → buffer, deltas → each            cache events)   step thread: calls, step, send
      stream's asyncio queue

The two ends talk over one `multiprocessing.connection` (a Unix socket with an auth key). The
child exits when the connection closes (the replica died or shut down: after the step in
flight), or when a step raises (what one request alone breaks ends that request inside the
step, docs/design.md §4.1: a step that raises is the engine's), after telling the replica why
(`_Died`). The replica treats that, or a closed connection, as the engine's death: `error` is
set, every open stream raises `EngineGoneError` (the replica hands its requests to the ingress,
which sends one elsewhere at most once more), pending calls fail, later ones fail at once.
Tensor parallelism keeps `AsyncEngine` (the ranks are started by the replica's launcher).

The child may run at a lower niceness than the replica (`niceness`, default −5 from the serve
config): the step thread is what every stream waits on, so when the HTTP side, Ray's own
processes and clients want more CPU than is left, the engine should get it first (measured:
+5 % output throughput at concurrency 32 on two cores). Lowering niceness needs CAP_SYS_NICE;
without it the child keeps the niceness it inherited and logs why (`set_niceness`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import cast

from core.events import CacheEvent, PageState
from core.outputs import EngineStats, StreamDelta
from core.reuse import TierCosts
from core.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.errors import EngineGoneError
from worker.heap import freeze_heap
from worker.hosts.streams import DeltaQueue, StreamingHost

_CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding `core` and `worker`
# The child's entry: this code's directory replaces the working directory at the head of its
# sys.path (a file planted in the replica's cwd is never imported), then this module runs as
# __main__ (what `python -P -m` does from Python 3.11 on; this runs on 3.10 too).
_CHILD_ENTRY = (
    "import runpy, sys; sys.path[0] = sys.argv.pop(1); "
    "runpy.run_module('worker.hosts.engine_process', run_name='__main__', alter_sys=True)"
)

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "SWASERVE_ENGINE_AUTHKEY"
IDLE_WAIT_S = 0.05  # how long the idle step thread waits before looking again
CALLS = (
    "check_integrity",
    "flush_cache",
    "cache_snapshot",
    "drain_and_snapshot",
)


# ---- messages (replica → child: _Add, _Abort, _Call, _Stop; child → replica: _Step, _Refused,
# _Reply, _Died) ----
@dataclass(frozen=True)
class _Start:
    config: EngineConfig
    niceness: int | None  # None: keep the inherited one


@dataclass(frozen=True)
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    follows: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    call_id: int
    name: str  # one of CALLS


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Step:
    deltas: list[StreamDelta]
    stats: EngineStats
    events: list[CacheEvent] = dataclasses.field(default_factory=list)  # queued up to now


@dataclass(frozen=True)
class _Refused:
    """The engine refused an `_Add` (it can never run: the `ValueError`'s message, which says
    what to change); the request was not added."""

    request_id: str
    message: str


@dataclass(frozen=True)
class _Died:
    """The child's step raised: it exits next (`why`: the exception, for the replica's log)."""

    why: str


@dataclass(frozen=True)
class _Reply:
    call_id: int
    ok: bool
    value: object  # the result, or the exception to raise


@dataclass(frozen=True)
class _Ready:
    """What the child tells the replica once its engine is built."""

    max_model_len: int
    model_dir: Path | None
    window: int | None
    swa_layers: int
    tier_costs: TierCosts | None
    stats: EngineStats
    niceness: int  # the child's, after `set_niceness`
    frozen_objects: int  # start-up's objects the child froze out of the collector's reach


class EngineProcess(StreamingHost):
    """An `EngineClient` whose engine runs in a child process (tensor-parallel size 1) at
    `niceness` (None: the replica's)."""

    def __init__(
        self, config: EngineConfig, start_timeout_s: float = 3600.0, niceness: int | None = None
    ) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError("EngineProcess runs one rank; tensor parallelism uses AsyncEngine")
        self.config = config
        key = secrets.token_bytes(32)
        address = os.path.join(tempfile.mkdtemp(prefix="swaserve-engine-"), "sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_ENTRY, str(_CODE_ROOT), address],
            env={**os.environ, AUTHKEY_ENV: key.hex()}, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            conn = _accept(listener, proc, start_timeout_s)
        finally:
            listener.close()  # removes the socket file; the connection stays
            shutil.rmtree(os.path.dirname(address), ignore_errors=True)
        conn.send(_Start(config, niceness))
        ready = conn.recv()
        if not isinstance(ready, _Ready):
            proc.wait(30)
            raise RuntimeError(f"the engine process failed to start:\n{ready}")
        self._attach(conn, proc, ready)

    def _attach(
        self, conn: Connection[object, object], proc: subprocess.Popen[bytes], ready: _Ready
    ) -> None:
        """The replica's side of a started child (`ready` received): state and reader thread."""
        self._conn, self._proc = conn, proc
        self._send_lock = threading.Lock()
        self.max_model_len = ready.max_model_len
        self.model_dir = ready.model_dir
        self.window = ready.window
        self.swa_layers = ready.swa_layers
        self.tier_costs = ready.tier_costs
        self.niceness = ready.niceness
        self.frozen_objects = ready.frozen_objects
        self.pid = self._proc.pid
        self._stats = ready.stats
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # streams, calls, error
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]] = {}
        self._calls: dict[int, tuple[str, Future[object]]] = {}
        self._events: list[CacheEvent] = []  # cache events received, not yet drained
        self._ids = itertools.count()
        self._reader = threading.Thread(
            target=self._read, name="swaserve-engine-reader", daemon=True
        )
        self._reader.start()

    # ---- EngineClient -----------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        return self._error

    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        follows: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream the request's deltas; stopping the iteration (or cancelling) aborts it. A
        request the engine refuses raises its `ValueError` before any delta (`_Refused`)."""

        async def start(_: DeltaQueue) -> None:
            try:
                self._send(_Add(request_id, token_ids, params, follows))
            except OSError:
                pass  # the child is gone: the reader ends this (registered) stream

        return self._relay(request_id, start)

    def abort(self, request_id: str) -> None:
        if self._error is None:
            self._send(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def check_integrity(self) -> None:
        self._call(_Call(0, "check_integrity"))

    def flush_cache(self) -> bool:
        return bool(self._call(_Call(0, "flush_cache")))

    def drain_cache_events(self) -> list[CacheEvent]:
        """Every event the engine queued up to its last step message: no round trip and no
        wait for the step in flight (each step message carries its events, read before its
        deltas, so a stream's final delta is never ahead of the events of its step)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    drain_cache_events_now = drain_cache_events  # `protocols.DrainsAtOnce`: never waits

    def cache_snapshot(self) -> dict[int, PageState]:
        return cast("dict[int, PageState]", self._call(_Call(0, "cache_snapshot")))

    def drain_and_snapshot(self) -> tuple[list[CacheEvent], dict[int, PageState]]:
        return cast(
            "tuple[list[CacheEvent], dict[int, PageState]]",
            self._call(_Call(0, "drain_and_snapshot")),
        )

    def shutdown(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send(_Stop())
            except OSError:
                pass
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(30)
        self._conn.close()
        self._reader.join(timeout=10)

    # ---- plumbing ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an internal error: {self._error!r}")

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _call(self, call: _Call, timeout: float = 60.0) -> object:
        """`call` (its id replaced by a fresh one) answered by the child."""
        fut: Future[object] = Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._ids)
            self._calls[call_id] = (call.name, fut)
        try:
            self._send(dataclasses.replace(call, call_id=call_id))
        except OSError:
            pass  # the child is gone: the reader fails this (registered) call
        return fut.result(timeout=timeout)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, _Died):
                    logger.error("the engine process's step failed: %s", message.why)
                    self._die(RuntimeError(f"the engine's step failed ({message.why})"))
                elif isinstance(message, _Step):
                    self._stats = message.stats
                    if message.events:
                        with self._lock:
                            self._events.extend(message.events)
                    self._route(message.deltas)
                elif isinstance(message, _Refused):
                    self._refuse(message)
                elif isinstance(message, _Reply):
                    value = message.value
                    with self._lock:
                        name, fut = self._calls.pop(message.call_id)
                        if name == "drain_and_snapshot" and message.ok:
                            # Events received before the reply precede the snapshot; later
                            # ones (after this point) follow it.
                            events, pages = cast(
                                "tuple[list[CacheEvent], dict[int, PageState]]", value
                            )
                            value, self._events = (self._events + events, pages), []
                    if message.ok:
                        fut.set_result(value)
                    else:
                        assert isinstance(message.value, BaseException)
                        fut.set_exception(message.value)
        except (EOFError, OSError) as exc:
            code = self._proc.poll()
            self._die(RuntimeError(f"the engine process is gone (exit code {code}): {exc!r}"))
        except BaseException as exc:  # noqa: BLE001 - surfaced to every caller
            logger.exception("engine process reader failed")
            self._die(exc)

    def _refuse(self, message: _Refused) -> None:
        with self._lock:
            stream = self._streams.get(message.request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, ValueError(message.message))

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or exc  # the first reason (`_Died`, then the closed connection)
            calls, self._calls = self._calls, {}
            streams, self._streams = dict(self._streams), {}
        for _, fut in calls.values():
            fut.set_exception(RuntimeError(f"engine stopped: {exc!r}"))
        for loop, q in streams.values():
            loop.call_soon_threadsafe(q.put_nowait, EngineGoneError(f"engine stopped: {exc!r}"))


def _accept(
    listener: Listener, proc: subprocess.Popen[bytes], timeout_s: float
) -> Connection[object, object]:
    """The child's connection; fails when the child exits first or `timeout_s` passes."""
    box: list[Connection[object, object] | BaseException] = []

    def accept() -> None:
        try:
            box.append(listener.accept())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box.append(exc)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not box:
        t.join(0.2)
        if not box and (proc.poll() is not None or time.monotonic() > deadline):
            if proc.poll() is None:
                proc.kill()
            raise RuntimeError(f"the engine process did not connect (exit code {proc.wait()})")
    got = box[0]
    if isinstance(got, BaseException):
        raise RuntimeError("the engine process did not connect") from got
    return got


# ---- the child ----------------------------------------------------------------------------------
class _Child:
    """The engine and its two threads: control (this connection's reader) and step."""

    def __init__(self, conn: Connection[object, object], config: EngineConfig) -> None:
        self.conn = conn
        self.engine = Engine(config)
        self.send_lock = threading.Lock()
        self.outbox: list[StreamDelta] = []  # filled by the sinks, on the step thread
        self.calls: list[tuple[int, str]] = []
        self.calls_lock = threading.Lock()
        self.wake = threading.Event()
        self.stop = threading.Event()

    def send(self, message: object) -> None:
        with self.send_lock:
            self.conn.send(message)

    def ready(self) -> _Ready:
        e = self.engine
        window = e.spec.window if e.spec.has_swa else None
        return _Ready(
            e.max_model_len, e.parts.model_dir, window, len(e.spec.swa_layer_ids), e.tier_costs, e.stats(),
            os.getpriority(os.PRIO_PROCESS, 0), gc.get_freeze_count(),
        )  # fmt: skip

    # control thread
    def control(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if isinstance(message, _Add):
                    self._add(message)
                elif isinstance(message, _Abort):
                    self.engine.abort(message.request_id)
                elif isinstance(message, _Call) and message.name in CALLS:
                    with self.calls_lock:
                        self.calls.append((message.call_id, message.name))
                elif isinstance(message, _Stop):
                    break
                else:
                    raise ValueError(f"unknown message from the replica: {message!r:.200}")
                self.wake.set()
        except (EOFError, OSError):
            pass  # the replica is gone: stop
        self.stop.set()
        self.wake.set()

    def _add(self, m: _Add) -> None:
        rid, token_ids, params, follows = m.request_id, m.token_ids, m.params, m.follows

        def add() -> None:
            try:
                self.engine.add_request(token_ids, params, rid, self._sink, follows)
            except ValueError as exc:  # it can never run: refused, as a check before it was
                self.send(_Refused(rid, str(exc)))
            except Exception as exc:  # noqa: BLE001 - the stream ends with it
                delta = StreamDelta(rid, [], True, "abort", len(token_ids), 0, 0, error=repr(exc))
                self.send(_Step([delta], self.engine.stats()))
            self.wake.set()

        if params.grammar is None:
            add()
        else:  # compiling a grammar takes a while: neither on this thread nor the step thread
            threading.Thread(target=add, daemon=True).start()

    def _sink(self, delta: StreamDelta) -> None:  # step thread
        self.outbox.append(delta)

    # step thread
    def step_loop(self) -> None:
        e = self.engine
        try:
            while not self.stop.is_set():
                self._run_calls()
                if e.has_work():
                    e.step()
                    self._publish()
                else:
                    self.wake.wait(IDLE_WAIT_S)
                    self.wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the replica hears of it, then we exit
            logger.exception("engine step loop died")
            self._publish()  # what finished before it (its streams' ends), then the death
            self.send(_Died(f"{type(exc).__name__}: {str(exc)[:500]}"))
            raise

    def _publish(self) -> None:
        out, self.outbox = self.outbox, []
        self.send(_Step(out, self.engine.stats(), self.engine.drain_cache_events()))

    def _run_calls(self) -> None:
        with self.calls_lock:
            calls, self.calls = self.calls, []
        e = self.engine
        if calls:  # events queued before the calls reach the replica before their replies
            self.send(_Step([], e.stats(), e.drain_cache_events()))
        for call_id, name in calls:
            try:
                if name == "drain_and_snapshot":
                    value: object = (e.drain_cache_events(), e.cache_snapshot())
                else:
                    fn: Callable[[], object] = getattr(e, name)
                    value = fn()
                reply = _Reply(call_id, True, value)
            except Exception as exc:  # noqa: BLE001 - raised in the replica
                reply = _Reply(call_id, False, exc)
            self.send(reply)
        if calls:
            self.send(_Step([], e.stats(), e.drain_cache_events()))


def set_niceness(niceness: int) -> int:
    """Set this process's niceness (every thread it has now; later ones inherit it) and return
    the niceness it runs at. Lowering it without CAP_SYS_NICE fails: logged, and the inherited
    niceness stays."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness == before:
        return before
    task_dir = Path("/proc/self/task")  # Linux: a niceness belongs to a thread
    threads = [int(t) for t in os.listdir(task_dir)] if task_dir.is_dir() else [0]
    try:
        for tid in threads:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except PermissionError as exc:  # on the first thread: they all start at `before`
        logger.info(
            "engine process niceness %d not applied (%s): a niceness below the replica's needs "
            "CAP_SYS_NICE; the engine runs at %d, as the HTTP side does (engine_niceness: null "
            "keeps the replica's without trying)", niceness, exc.strerror, before,
        )  # fmt: skip
    return os.getpriority(os.PRIO_PROCESS, 0)


def _serve(address: str) -> int:
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    start = conn.recv()
    config = start.config
    if start.niceness is not None:
        set_niceness(start.niceness)
    try:
        child = _Child(conn, config)
    except BaseException:  # noqa: BLE001 - the replica raises it
        conn.send(traceback.format_exc())
        return 1
    freeze_heap()
    conn.send(child.ready())
    control = threading.Thread(target=child.control, name="swaserve-engine-control", daemon=True)
    control.start()
    try:
        child.step_loop()
    finally:
        child.engine.close()
    return 0


if __name__ == "__main__":
    # NOTE: through the module's own name, so what crosses the connection unpickles in the replica
    from worker.hosts import engine_process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    sys.exit(engine_process._serve(sys.argv[1]))

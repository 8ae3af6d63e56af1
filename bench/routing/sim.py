"""A simulated cluster: N real engines (with `SimRunner`), one `RouterCore`, virtual time.

One discrete-event loop drives everything, the way the deployed system is wired:

    arrival ──▶ RouterCore.decide(prompt, candidates = every worker + its last load sample)
                  └─▶ the first-ranked worker's engine.add_request
    step start: engine.step() (admits what is queued, schedules, runs the SimRunner), then the
                step's cache events are drained; the step lasts StepCost(tokens it fed, bytes
                of KV it loaded from its host tier)
    step end:   the events reach the ClusterIndex as one EventBatch (seq + 1), first tokens and
                finished requests are recorded, `complete(rid)` tells the router, a closed-loop
                workload sends its follow-up; the next step starts if the engine has work
    stats tick: every `stats_period_s` each worker's routing stats are sampled (Serve polls
                `record_routing_stats` on that period) with `cluster.messages.routing_stats`,
                the function the deployed worker's `record_routing_stats` calls

NOTE: `engine.step()` runs at the start of its virtual step, so the engine's own state is one
step ahead of the index while a step is in flight; the index sees the step at its end, as the
real index sees a step only after its events are published. A decision made while the chosen
worker is idle therefore sees an index equal to that worker's cache ("quiet" decisions below).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.routing.workloads import SimRequest, Workload
from bench.sim_runner import SimRunner, StepCost, build_sim_engine
from cluster.index import ApplyOutcome, ClusterIndex
from cluster.messages import (
    CacheSnapshot,
    EventBatch,
    WorkerLoad,
    WorkerMeta,
    WorkerResync,
    routing_stats,
)
from core.events import EventKind
from core.geometry import Geometry
from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from router.core import Candidate, RouterCore
from router.policies import make_policy
from worker.config import EngineConfig, repairs_tombstones
from worker.engine.engine import Engine
from worker.models.spec import ModelSpec

_STEP_END, _ARRIVAL, _TICK = 0, 1, 2  # tie order at equal times: finish steps, then route
_TOMBSTONE_KINDS = (EventKind.SWA_REMOVED, EventKind.STORED_FULL_ONLY)


@dataclass(frozen=True)
class SimCluster:
    """Per-worker engine settings and the simulated clock (see `StepCost`)."""

    workers: int = 16
    page_size: int = 16
    window: int = 128
    full_tokens: int = 16_384
    swa_ratio: float = 0.25  # SWA pool = ratio × full pool (hybrid pools)
    disable_hybrid: bool = False  # one pool: SWA layers keep all their KV, no tombstones
    chunked_prefill_size: int = 512  # the former deployed default (the simulator keeps it)
    max_running_requests: int = 64
    swa_eviction_interval: int = 128
    stats_period_s: float = 1.0  # deploy.app.ROUTING_STATS_PERIOD_S
    cost: StepCost = field(default_factory=StepCost)
    swa_eviction_policy: str = "tail_first"
    tombstone_repair: str = "auto"
    host_kv_bytes: int = 0  # each worker's host KV tier (docs/design.md §9.9); 0: none
    spec: ModelSpec | None = None  # a real layer plan (bench.routing.stacks); None: sim_spec

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model="sim",
            page_size=self.page_size,
            max_total_tokens=self.full_tokens,
            swa_full_tokens_ratio=self.swa_ratio,
            disable_hybrid_swa_memory=self.disable_hybrid,
            chunked_prefill_size=self.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            swa_eviction_interval=self.swa_eviction_interval,
            swa_eviction_policy=self.swa_eviction_policy,
            tombstone_repair=self.tombstone_repair,
            host_kv_bytes=self.host_kv_bytes,
            host_link_gbps=self.cost.link_gbps,
        )


@dataclass(slots=True)
class Track:
    """One request's life in the simulation."""

    req: SimRequest
    worker: str
    predicted: int  # the policy's predicted cached tokens on the chosen worker
    predicted_loaded: int  # ... and KV tokens loaded from its host tier (full and SWA apart)
    quiet: bool  # the worker was idle at the decision: the index equalled its cache
    decision_us: float
    output: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    finish_s: float | None = None
    cached: int = -1
    loaded: int = 0  # KV tokens the engine loaded for it (`StreamDelta.loaded_tokens`)


@dataclass
class _Worker:
    wid: str
    engine: Engine
    runner: SimRunner
    seq: int = 0
    busy: bool = False
    # the running step's deltas and cache events, delivered at its end
    inflight: tuple[list[StreamDelta], list] = field(default_factory=lambda: ([], []))
    load: WorkerLoad | None = None
    tombstone_pages: int = 0
    loaded_bytes: int = 0  # what its engine had loaded after its last step (a monotonic count)


@dataclass
class SimOutcome:
    """Raw results of one run; `figures.summarize` turns them into figures."""

    policy: str
    cluster: SimCluster
    tracks: list[Track]
    prefill_tokens: int  # tokens fed as prefill (runner count minus decode feeds), repairs included
    repaired_tokens: int  # of those, repair rows (docs/design.md §9.8)
    repairs: int  # admissions through a repair
    tombstone_pages: int  # pages that became tombstones (SWA_REMOVED + STORED_FULL_ONLY)
    retractions: int
    swa_evicted_tokens: int
    full_evicted_tokens: int
    wall_s: float
    loads: int = 0  # admissions that loaded KV from a host tier
    loaded_full_tokens: int = 0  # full KV loaded (tokens, every full layer)
    loaded_swa_tokens: int = 0
    offloaded_tokens: int = 0  # tokens any of whose KV moved to a host tier


class Simulation:
    def __init__(self, cluster: SimCluster, policy: str, workload: Workload) -> None:
        self.cluster = cluster
        self.workload = workload
        self.index = ClusterIndex()
        self.core = RouterCore(self.index, make_policy(policy))
        self.workers = {w.wid: w for w in (self._worker(i) for i in range(cluster.workers))}
        self.tracks: dict[str, Track] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._n = 0
        self._candidates: list[Candidate] = []

    def _worker(self, i: int) -> _Worker:
        c = self.cluster
        engine, runner = build_sim_engine(c.engine_config(), c.window, c.spec, c.cost)
        wid = f"w{i:03d}"
        s = engine.stats()
        window = engine.spec.window if s.hybrid else None
        geometry = Geometry(c.page_size, window, len(engine.spec.swa_layer_ids))
        # What the deployed worker registers (deploy/replica/events.py `_meta`).
        meta = WorkerMeta(
            wid, "sim", geometry, s.full.total, s.swa.total, s.hybrid,
            repairs_tombstones(engine.config), engine.tier_costs, s.host_full.total,
        )  # fmt: skip
        # A fresh replica registers with an empty snapshot at seq 0; its batch 1 applies directly.
        self.index.resync(WorkerResync(meta, CacheSnapshot(wid, "sim", 0, {})))
        return _Worker(wid, engine, runner)

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> SimOutcome:
        t0 = time.perf_counter()
        for req in self.workload.initial():
            self._push(req.arrival_s, _ARRIVAL, req)
        self._tick(0.0, None)  # the first load sample before any arrival
        handlers: dict[int, Callable[[float, object], None]] = {
            _STEP_END: self._end_step, _ARRIVAL: self._arrive, _TICK: self._tick,
        }  # fmt: skip
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            handlers[kind](t, payload)
        return self._outcome(time.perf_counter() - t0)

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, kind, self._n, payload))

    def _tick(self, t: float, _: object) -> None:
        for w in self.workers.values():
            w.load = WorkerLoad.from_routing_stats(routing_stats(w.engine.stats(), w.wid, t))
        self._candidates = [Candidate(w.wid, w.load) for w in self.workers.values()]
        if any(kind != _TICK for _, kind, _, _ in self._heap):
            self._push(t + self.cluster.stats_period_s, _TICK, None)

    def _arrive(self, t: float, payload: object) -> None:
        req: SimRequest = payload  # type: ignore[assignment]
        start = time.perf_counter()
        decision = self.core.decide(
            req.tokens, self._candidates, max_new_tokens=req.max_tokens, request_key=req.rid, now=t
        )
        elapsed_us = (time.perf_counter() - start) * 1e6
        best = decision.best
        assert best is not None, "no candidate worker"
        w = self.workers[best.worker_id]
        self.tracks[req.rid] = Track(
            req, w.wid, best.predicted_cached_tokens, best.predicted_loaded_tokens, not w.busy,
            elapsed_us,
        )  # fmt: skip
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        w.engine.add_request(list(req.tokens), params, req.rid)
        if not w.busy:
            self._start_step(w, t)

    def _start_step(self, w: _Worker, t: float) -> None:
        steps = w.engine.counters.steps
        deltas = w.engine.step()
        if w.engine.counters.steps == steps:
            raise RuntimeError(
                f"worker {w.wid} has {w.engine.stats().waiting} waiting requests but scheduled "
                "nothing with no step in flight (a request that can never be admitted: enlarge "
                "--full-tokens or the SWA ratio)"
            )
        w.inflight = (deltas, w.engine.drain_cache_events())
        w.busy = True
        r = w.runner
        # The KV this step loaded (its copies ran before its forward: the forward waits).
        total = w.engine.stats().loaded_bytes
        loaded, w.loaded_bytes = total - w.loaded_bytes, total
        seconds = self.cluster.cost.seconds(r.last_prefill_tokens, r.last_decode_tokens, loaded)
        self._push(t + seconds, _STEP_END, w)

    def _end_step(self, t: float, payload: object) -> None:
        w: _Worker = payload  # type: ignore[assignment]
        deltas, events = w.inflight
        w.busy = False
        if events:
            self._publish(w, events)
        for d in deltas:
            self._record(d, t)
        if w.engine.has_work():
            self._start_step(w, t)

    def _publish(self, w: _Worker, events: list) -> None:
        w.seq += 1
        outcome = self.index.apply(EventBatch(w.wid, "sim", w.seq, tuple(events)))
        assert outcome is ApplyOutcome.APPLIED, f"index refused batch {w.seq} of {w.wid}: {outcome}"
        w.tombstone_pages += sum(len(e.page_hashes) for e in events if e.kind in _TOMBSTONE_KINDS)

    def _record(self, d: StreamDelta, t: float) -> None:
        track = self.tracks[d.request_id]
        if d.token_ids and track.first_token_s is None:
            track.first_token_s = t
        track.output.extend(d.token_ids)
        if not d.finished:
            return
        track.finish_s, track.cached, track.loaded = t, d.cached_tokens, d.loaded_tokens
        self.core.complete(d.request_id, now=t)
        nxt = self.workload.follow_up(track.req, track.output, t)
        if nxt is not None:
            self._push(nxt.arrival_s, _ARRIVAL, nxt)

    # ---- results --------------------------------------------------------------------------
    def host_tokens(self) -> tuple[int, int]:
        """(full, SWA) tokens of one worker's host tier (every worker has the same; 0: none)."""
        s = next(iter(self.workers.values())).engine.stats()
        return s.host_full.total, s.host_swa.total

    def _outcome(self, wall_s: float) -> SimOutcome:
        tracks = list(self.tracks.values())
        unfinished = [tr.req.rid for tr in tracks if tr.finish_s is None]
        assert not unfinished, f"requests never finished: {unfinished[:5]}"
        fed = sum(w.runner.fed_tokens for w in self.workers.values())
        # Every output token but the last is fed back once as a decode; the rest was prefill
        # (including re-prefill after a retraction).
        decodes = sum(len(tr.output) - 1 for tr in tracks)
        stats = [w.engine.stats() for w in self.workers.values()]
        for w in self.workers.values():
            w.engine.check_integrity()
        return SimOutcome(
            policy=self.core.policy.name,
            cluster=self.cluster,
            tracks=tracks,
            prefill_tokens=fed - decodes,
            repaired_tokens=sum(w.runner.repair_tokens for w in self.workers.values()),
            repairs=sum(s.repairs for s in stats),
            tombstone_pages=sum(w.tombstone_pages for w in self.workers.values()),
            retractions=sum(s.retractions for s in stats),
            swa_evicted_tokens=sum(s.swa_evicted_tokens for s in stats),
            full_evicted_tokens=sum(s.full_evicted_tokens for s in stats),
            wall_s=wall_s,
            loads=sum(w.engine.scheduler.counters.loads for w in self.workers.values()),
            loaded_full_tokens=sum(s.loaded_full_tokens for s in stats),
            loaded_swa_tokens=sum(s.loaded_swa_tokens for s in stats),
            offloaded_tokens=sum(s.offloaded_tokens for s in stats),
        )


def simulate(cluster: SimCluster, policy: str, workload: Workload) -> SimOutcome:
    """Run `workload` through a fresh simulated cluster routed by `policy`."""
    return Simulation(cluster, policy, workload).run()

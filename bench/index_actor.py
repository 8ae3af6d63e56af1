"""`swaserve bench index-actor`: the index actor over real Ray, what each push and pull costs.

`swaserve bench index-ingest` measures the index's own work (apply, log, pull, replay) on one
core, without Ray. This plays the same synthetic fleet (`bench.event_streams`) through the real
`CacheIndexActor` on a local Ray cluster, as the deployment does:

- *workers*: `--fleets` Ray actors each play their share of the workers in real time, one
  `push` actor call per worker per step, each worker's pushes awaited in order (what
  `cluster.transport.EventPublisher` does); a worker that finds the previous push still
  unanswered at its next step falls behind, and the run counts how late its pushes went out;
- *routers*: `--routers` Ray actors each follow the index with the deployment's
  `IndexSubscriber` (a long poll, woken by every push that changes the index), noting when each
  batch reached its local index.

Reported per fleet size: pushes offered and made per second (and the share on the actor's
event socket, `cluster/event_socket.py`), the index actor's share of a core and its CPU per push
or delta delivered to a router (pulls, which are actor calls, or deltas streamed on the socket),
so the push rate one core sustains at this mix; the push round trip and the lag from a push's
send to every router holding it (p50 / p99 / max); the deltas delivered per second; the CPU per
push of the processes playing the workers (a worker replica's cost per push on top of its
engine) and the routers' per delta. Consistent: every router's index equals a replay of the
streams.

The workers' steps are `--step-ms` apart: a worker replica pushes once per finished request
(group-committed) and every 250 ms in the background, so a 20 ms step stands for a replica
finishing about 50 requests a second. On a machine with few cores the players and routers
share the actor's cores; the actor's CPU per call is what extrapolates.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from bench.event_streams import (
    FleetStream,
    Stream,
    add_fleet_arguments,
    fleet_from_args,
    make_stream,
)
from bench.harness import (
    add_output_arguments,
    markdown_table,
    prepare_output_dir,
    write_json,
    write_text,
)
from bench.machine import load_average
from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, Delta, EventBatch, WorkerResync
from core.events import PageState, replay

ACTOR_NAME = "swaserve-cache-index:bench:index-actor"


@dataclass(frozen=True)
class ActorSettings:
    fleet: FleetStream = FleetStream()
    duration_s: float = 5.0  # of stream time, played in real time
    fleets: int = 2  # actors playing the workers
    routers: int = 1  # actors following the index
    settle_s: float = 30.0  # how long the routers may take to catch up after the last push


@dataclass(frozen=True)
class ActorFigures:
    workers: int
    routers: int
    offered_pushes_per_s: float
    pushes_per_s: float  # made, over the played time
    socket_share: float  # of them, on the event socket (the rest: actor calls)
    page_events_per_s: float
    late_ms: tuple[float, float]  # p50, p99 of how late a push went out (its worker was behind)
    actor_core: float  # the index actor's CPU over the played time, in cores
    deltas_per_s: float  # delivered to the routers, all together (pulls and streamed)
    actor_us_per_message: float  # actor CPU / (pushes + deltas)
    one_core_pushes_per_s: float  # pushes/s at which the actor's core would be full, at this mix
    push_rtt_ms: tuple[float, float, float]  # p50, p99, max of send → answered
    lag_ms: tuple[float, float, float]  # p50, p99, max of send → in every router's index
    players_us_per_push: float  # the players' CPU per push (a worker replica's side)
    routers_us_per_delta: float  # the routers' CPU per delta, apply included
    consistent: bool


def _digest(pages: dict[int, PageState]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for page, state in sorted(pages.items()):
        h.update(f"{page}:{state.value};".encode())
    return h.hexdigest()


def _cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    return (statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], ordered[-1])


def _same(snapshot: CacheSnapshot) -> CacheSnapshot:
    return snapshot


class Player:
    """Plays some workers' batches into the index actor in real time, each worker through an
    `EventPublisher` as a worker replica pushes (a Ray actor)."""

    def __init__(self, actor_name: str, namespace: str) -> None:
        import ray

        self._actor = ray.get_actor(actor_name, namespace=namespace)

    async def register(self, resyncs: list[WorkerResync]) -> None:
        """One `EventPublisher` per worker, started (its snapshot sent) as a replica's is."""
        from cluster.transport import EventPublisher

        self._publishers: dict[str, EventPublisher] = {}
        for r in resyncs:
            assert r.snapshot is not None
            p = EventPublisher(self._actor, r.meta, functools.partial(_same, r.snapshot))
            self._publishers[r.meta.worker_id] = p
            await p.start()

    async def play(
        self, batches: list[tuple[float, EventBatch]], start: float
    ) -> tuple[list[tuple[str, int, float, float, float]], int]:
        """(worker, seq, due, sent, answered) per push, `time.monotonic()` (one clock for every
        process of the machine), and how many went on the event socket; each worker's pushes
        in order, the next one after the answer."""
        from cluster.transport import EventPublisher

        publishers = self._publishers
        by_worker: dict[str, list[tuple[float, EventBatch]]] = {w: [] for w in publishers}
        for t, batch in batches:
            by_worker[batch.worker_id].append((t, batch))
        out: list[tuple[str, int, float, float, float]] = []

        async def worker(publisher: EventPublisher, steps: list[tuple[float, EventBatch]]) -> None:
            for t, batch in steps:
                due = start + t
                pause = due - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)  # NOTE: pacing a benchmark's stream
                sent = time.monotonic()
                await publisher.publish(batch)
                out.append((batch.worker_id, batch.seq, due, sent, time.monotonic()))

        await asyncio.gather(*(worker(publishers[w], steps) for w, steps in by_worker.items()))
        return out, sum(p.socket_pushes for p in publishers.values())


class Router:
    """Follows the index actor as a router does (`IndexSubscriber`), noting when each batch
    arrived (a Ray actor)."""

    def __init__(self, actor_name: str, namespace: str) -> None:
        import ray

        from cluster.transport import IndexSubscriber

        seen: dict[tuple[str, int], float] = {}  # (worker, seq) → when it was in the local index
        pulls = [0]
        self.seen, self.pulls = seen, pulls

        class Timed(IndexSubscriber):
            async def sync(self, wait_s: float = 0.0) -> bool:
                pulls[0] += 1
                return await super().sync(wait_s)

            def _apply(self, delta: Delta) -> bool:
                applied = super()._apply(delta)
                if applied:
                    now = time.monotonic()
                    for u in delta.updates:
                        if isinstance(u, EventBatch):
                            seen.setdefault((u.worker_id, u.seq), now)
                return applied

        self.index = ClusterIndex()
        self._sub = Timed(ray.get_actor(actor_name, namespace=namespace), self.index)

    async def start(self, workers: int, timeout_s: float) -> bool:
        """Follow from now on; True once the index holds `workers` workers."""
        self._sub.start()
        deadline = time.monotonic() + timeout_s
        while len(list(self.index.workers())) < workers:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)  # waits on the resyncs reaching this router
        return True

    def delivered(self) -> int:
        """Deltas delivered: long polls and catch-ups (actor calls) plus those streamed on the
        actor's event socket."""
        return self.pulls[0] + self._sub.socket_deltas

    async def wait_for(self, last: dict[str, int], timeout_s: float) -> bool:
        """True once every worker's batch `last[worker]` is in the local index."""
        deadline = time.monotonic() + timeout_s
        while any((w, s) not in self.seen for w, s in last.items()):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)  # waits on the routers' pulls
        return True

    async def report(self) -> tuple[dict[tuple[str, int], float], int, dict[str, str]]:
        await self._sub.stop()
        digests = {}
        for wid in [e.meta.worker_id for e in self.index.workers()]:
            snap = self.index.snapshot(wid)
            digests[wid] = _digest(dict(snap.pages)) if snap is not None else ""
        return self.seen, self.delivered(), digests


def expected_digests(stream: Stream) -> dict[str, str]:
    pages = {r.meta.worker_id: dict(r.snapshot.pages) for r in stream.resyncs if r.snapshot is not None}
    for _, batch, _ in stream.batches:
        replay(batch.events, pages[batch.worker_id])
    return {wid: _digest(p) for wid, p in pages.items()}


def _pid(handle: Any) -> int:
    """The process of a Ray actor (any class: `__ray_call__` runs a function inside it)."""
    import ray

    return int(ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))


def measure(s: ActorSettings) -> ActorFigures:
    """One fleet size through a fresh index actor on the running Ray cluster."""
    import ray

    from cluster.index import IndexLimits
    from cluster.transport import INDEX_NAMESPACE, get_or_create_index_actor, kill_index_actor

    stream = make_stream(s.fleet, s.duration_s)
    f = s.fleet
    limits = IndexLimits(max_pages_per_worker=4 * f.cache_pages, max_workers=max(64, f.workers))
    name = f"{ACTOR_NAME}:{f.workers}:{s.routers}"  # a fresh actor per fleet size
    actor = get_or_create_index_actor(name, limits=limits)  # the deployed log length
    helpers: list[Any] = []
    try:
        players: list[Any] = [ray.remote(num_cpus=0)(Player).remote(name, INDEX_NAMESPACE) for _ in range(s.fleets)]
        routers: list[Any] = [ray.remote(num_cpus=0)(Router).remote(name, INDEX_NAMESPACE) for _ in range(s.routers)]
        helpers = players + routers
        share: list[list[tuple[float, EventBatch]]] = [[] for _ in players]
        resyncs: list[list[WorkerResync]] = [[] for _ in players]
        order = {r.meta.worker_id: i for i, r in enumerate(stream.resyncs)}
        for r in stream.resyncs:
            resyncs[order[r.meta.worker_id] % len(players)].append(r)
        for t, batch, _ in stream.batches:
            share[order[batch.worker_id] % len(players)].append((t, batch))
        pids = {"actor": [_pid(actor)], "players": [_pid(p) for p in players], "routers": [_pid(r) for r in routers]}
        ray.get([p.register.remote(r) for p, r in zip(players, resyncs)])
        if not all(ray.get([r.start.remote(f.workers, 60.0) for r in routers])):
            raise RuntimeError("a router did not see every worker's resync within 60 s")
        delivered_before = sum(ray.get([r.delivered.remote() for r in routers]))
        before = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
        start = time.monotonic() + 0.5
        parts = ray.get([p.play.remote(b, start) for p, b in zip(players, share)])
        records = [rec for part, _ in parts for rec in part]
        on_socket = sum(n for _, n in parts)
        played = time.monotonic() - start
        after_play = _cpu_s(pids["actor"][0])
        last: dict[str, int] = {}
        for wid, seq, *_ in records:
            last[wid] = max(seq, last.get(wid, 0))
        caught_up = all(ray.get([r.wait_for.remote(last, s.settle_s) for r in routers]))
        cpu = {k: sum(_cpu_s(p) for p in v) - before[k] for k, v in pids.items()}
        reports = ray.get([r.report.remote() for r in routers])
    finally:
        for h in helpers:
            ray.kill(h)
        kill_index_actor(name)
    pushes, deltas = len(records), sum(n for _, n, _ in reports) - delivered_before
    actor_cpu = after_play - before["actor"]
    # the actor's CPU while the players played, over the messages it handled meanwhile (the
    # deltas after the last push are few: they count in `deltas` but not in this CPU)
    lags = [max(seen[(w, q)] for seen, _, _ in reports) - sent for w, q, _, sent, _ in records
            if all((w, q) in seen for seen, _, _ in reports)]  # fmt: skip
    want = expected_digests(stream)
    consistent = caught_up and len(records) == len(stream.batches) and all(d == want for _, _, d in reports)
    core = actor_cpu / played
    per_message = actor_cpu / max(1, pushes + deltas)
    return ActorFigures(
        workers=f.workers, routers=s.routers,
        offered_pushes_per_s=len(stream.batches) / stream.seconds, pushes_per_s=pushes / played,
        socket_share=on_socket / max(1, pushes),
        page_events_per_s=stream.page_events / played,
        late_ms=_quantiles([(sent - due) * 1e3 for _, _, due, sent, _ in records])[:2],
        actor_core=core, deltas_per_s=deltas / played, actor_us_per_message=per_message * 1e6,
        one_core_pushes_per_s=pushes / played / core if core > 0 else float("inf"),
        push_rtt_ms=tuple(x * 1e3 for x in _quantiles([ans - sent for *_, sent, ans in records])),  # type: ignore[arg-type]
        lag_ms=tuple(x * 1e3 for x in _quantiles(lags)),  # type: ignore[arg-type]
        players_us_per_push=cpu["players"] / max(1, pushes) * 1e6,
        routers_us_per_delta=cpu["routers"] / max(1, deltas) * 1e6,
        consistent=consistent,
    )  # fmt: skip


def table(figures: list[ActorFigures]) -> str:
    headers = ["workers", "routers", "pushes/s offered / made", "on the socket", "page ev/s", "push late p50 / p99 ms",
               "actor cores", "deltas/s to routers", "actor µs per push or delta", "pushes/s one core sustains",
               "push RTT p50 / p99 / max ms", "lag p50 / p99 / max ms", "players µs per push",
               "routers µs per delta", "consistent"]  # fmt: skip
    rows = [
        [f.workers, f.routers, f"{f.offered_pushes_per_s:,.0f} / {f.pushes_per_s:,.0f}", f"{f.socket_share:.0%}",
         f"{f.page_events_per_s:,.0f}",
         " / ".join(f"{x:.1f}" for x in f.late_ms), f"{f.actor_core:.2f}", f"{f.deltas_per_s:,.0f}",
         f"{f.actor_us_per_message:.0f}", f"{f.one_core_pushes_per_s:,.0f}",
         " / ".join(f"{x:.1f}" for x in f.push_rtt_ms), " / ".join(f"{x:.1f}" for x in f.lag_ms),
         f"{f.players_us_per_push:.0f}", f"{f.routers_us_per_delta:.0f}", "yes" if f.consistent else "NO"]
        for f in figures
    ]  # fmt: skip
    return markdown_table(headers, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ActorSettings()
    add_fleet_arguments(parser)
    a = parser.add_argument
    a("--duration", type=float, default=d.duration_s, help="seconds of stream played per fleet size")
    a("--fleets", type=int, default=d.fleets, help="Ray actors playing the workers")
    a("--routers", type=int, default=d.routers, help="Ray actors following the index")
    a("--num-cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    add_output_arguments(parser, "bench_results/index_actor")


def run(args: argparse.Namespace) -> int:
    from bench.local_serve import quiet_ray_logs
    from cluster.ray_local import LocalRayConfig, local_ray

    fleet = fleet_from_args(args)
    base = ActorSettings(fleet, args.duration, args.fleets, args.routers)
    load_before = load_average()
    figures = []
    with local_ray(LocalRayConfig(num_cpus=args.num_cpus)):
        quiet_ray_logs()
        for w in args.workers:
            figures.append(measure(replace(base, fleet=replace(fleet, workers=w))))
            print(table(figures[-1:]), flush=True)
    text = f"{table(figures)}\n\n1-minute load average {load_before:.2f} before, {load_average():.2f} after."
    out = prepare_output_dir(args.output_dir)
    settings: dict[str, Any] = {"settings": base, "figures": figures}
    write_json(out / "index_actor.json", settings)
    write_text(out / "index_actor.md", text)
    print(text)
    return 0 if all(f.consistent for f in figures) else 1

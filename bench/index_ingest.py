"""`swaserve bench index-ingest`: does one index actor keep up with a GPU cluster's cache events?

Input: `bench.event_streams` (W workers in steady state, each prefilling `--rate` tokens/s at
page P: 64 × 20K tokens/s at page 16 stores 80K pages/s, about 2.5 page events per stored page
with SWA removals and evictions). Per fleet size (`--workers 8 32 64`):

- *hub*: the stream pushed into an `IndexHub` (the index actor's logic, `push` and the pulls it
  serves) as fast as it goes, on one core: the page events/s it sustains;
- *router*: the pulled deltas (one pull per `--pull-ms` of stream time) replayed into a
  router's `ClusterIndex` (`apply_delta`, what `IndexSubscriber` does), as fast as it goes;
- *paced*: the stream played in real time for `--duration` s with hub push, router pull + apply
  and `RouterCore.decide` (`--decisions` per second over every worker, prompts on the shared
  prefixes plus a unique tail) interleaved on ONE core, the pessimistic case (the deployment
  runs the actor and each router in their own processes): each batch's lag (published → held
  by the router's index), the loop's busy fraction, and the decision's latency while the index
  ingests.

Consistency: every pushed batch applied (page events applied == sent), and the hub's and the
router's index equal a replay of the streams (`core.events.replay` on each worker's snapshot).
Ray's own cost per push (serialisation, the actor call) is not in these figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

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
from cluster.index_hub import IndexHub, apply_delta
from cluster.messages import PoolHeadroom, WorkerLoad
from core.events import replay
from router.core import Candidate, RouterCore
from router.policies import make_policy


@dataclass(frozen=True)
class IngestSettings:
    fleet: FleetStream = FleetStream()
    stream_s: float = 2.0  # stream time of the unpaced measurements
    duration_s: float = 2.0  # the paced run (wall clock)
    pull_ms: float = 10.0  # the router pulls this often
    decisions: float = 200.0  # per second, in the paced run
    policy: str = "swa_prefix"


@dataclass(frozen=True)
class IngestFigures:
    workers: int
    produced_per_s: float  # page events/s the fleet produces
    events: int  # page events in the unpaced stream
    applied: int  # of them, in batches the hub applied
    hub_per_s: float  # page events/s the hub ingests (one core)
    router_per_s: float  # page events/s a router replays from its pulls (one core)
    consistent: bool  # applied == events and both indexes equal the replay
    lag_ms: tuple[float, float, float]  # paced: p50, p99, max of published → in the router's index
    behind: int  # paced: batches published but not in the router's index when it ended
    busy: float  # paced: the loop's busy fraction of its core
    decisions: int
    decide_us: tuple[float, float]  # paced: p50, p99 of `RouterCore.decide`, wall clock
    decide_cpu_us: tuple[float, float]  # ... in this thread's CPU time

    @property
    def keeps_up(self) -> bool:
        return min(self.hub_per_s, self.router_per_s) >= self.produced_per_s


def _hub(stream: Stream) -> tuple[IndexHub, ClusterIndex, int, str]:
    """A hub holding every worker's starting cache, and a router index bootstrapped from it."""
    hub = IndexHub(max_log=1 << 20)
    for r in stream.resyncs:
        hub.resync(r)
    router = ClusterIndex()
    delta = hub.pull(None, 0)
    assert delta is not None
    apply_delta(router, delta)
    return hub, router, delta.cursor, delta.epoch


def measure_unpaced(stream: Stream, pull_s: float) -> tuple[float, float, int, bool]:
    """(hub page events/s, router page events/s, page events applied, consistent).

    NOTE: per second of this thread's CPU time, not wall clock: on a shared machine that is what
    one core sustains (wall clock would count other processes' time slices as ours)."""
    hub, router, cursor, epoch = _hub(stream)
    hub_s = router_s = 0.0
    applied, i, batches = 0, 0, stream.batches
    while i < len(batches):
        window = int(batches[i][0] / pull_s)
        t0 = time.thread_time()
        while i < len(batches) and int(batches[i][0] / pull_s) == window:
            end = hub.end
            hub.push(batches[i][1])
            applied += batches[i][2] if hub.end > end else 0  # only an applied batch is logged
            i += 1
        delta = hub.pull(epoch, cursor)
        t1 = time.thread_time()
        assert delta is not None and not delta.reset
        apply_delta(router, delta)
        cursor = delta.cursor
        hub_s, router_s = hub_s + t1 - t0, router_s + time.thread_time() - t1
    n = stream.page_events
    return n / hub_s, n / router_s, applied, applied == n and equal_replay(stream, hub.index, router)


def equal_replay(stream: Stream, *indexes: ClusterIndex) -> bool:
    """Every index holds exactly each worker's snapshot with its batches replayed."""
    expected = {r.meta.worker_id: dict(r.snapshot.pages) for r in stream.resyncs if r.snapshot is not None}
    for _, batch, _ in stream.batches:
        replay(batch.events, expected[batch.worker_id])
    return all(
        (snap := index.snapshot(wid)) is not None and snap.pages == pages
        for index in indexes
        for wid, pages in expected.items()
    )


@dataclass(frozen=True)
class Paced:
    lag_ms: tuple[float, float, float]
    behind: int
    busy: float
    decide_us: list[float]  # wall clock
    decide_cpu_us: list[float]  # this thread's CPU time (what other processes' slices do not add)


def measure_paced(stream: Stream, s: IngestSettings) -> Paced:
    """Play `stream` in real time with decisions; everything on this one thread."""
    hub, router, cursor, epoch = _hub(stream)
    core = RouterCore(router, make_policy(s.policy))
    cands, prompts = _candidates(stream), _prompts(stream, 64)
    batches, pull_s, every = stream.batches, s.pull_ms / 1000, 1 / s.decisions
    lags: list[float] = []
    decide_us: list[float] = []
    decide_cpu_us: list[float] = []
    pushed = held = 0
    next_pull = next_decision = idle = 0.0
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < s.duration_s:
        while pushed < len(batches) and batches[pushed][0] <= now:
            hub.push(batches[pushed][1])
            pushed += 1
        if now >= next_pull:
            delta = hub.pull(epoch, cursor)
            if delta is not None:
                apply_delta(router, delta)
                cursor, done = delta.cursor, time.perf_counter() - start
                lags += [done - batches[k][0] for k in range(held, pushed)]
                held = pushed
            next_pull += pull_s
        if now >= next_decision:
            key = len(decide_us)
            t0, c0 = time.perf_counter(), time.thread_time()
            core.decide(prompts[key % len(prompts)], cands, max_new_tokens=256, request_key=f"r{key}")
            decide_us.append((time.perf_counter() - t0) * 1e6)
            decide_cpu_us.append((time.thread_time() - c0) * 1e6)
            core.complete(f"r{key - 32}")  # about 32 requests in flight
            next_decision += every
        wake = min(next_pull, next_decision, batches[pushed][0] if pushed < len(batches) else s.duration_s)
        pause = wake - (time.perf_counter() - start)
        if pause > 0:
            idle += pause
            time.sleep(pause)  # NOTE: pacing a benchmark, not synchronising a test
    elapsed = time.perf_counter() - start
    lags.sort()
    q = (lags[len(lags) // 2], lags[int(len(lags) * 0.99)], lags[-1]) if lags else (0.0, 0.0, 0.0)
    lag = (q[0] * 1e3, q[1] * 1e3, q[2] * 1e3)
    return Paced(lag, stream.until(elapsed) - held, 1 - idle / elapsed, decide_us, decide_cpu_us)


def _candidates(stream: Stream) -> list[Candidate]:
    pool = PoolHeadroom(1 << 20, 1 << 18, 1 << 22)
    now = time.time()
    return [
        Candidate(r.meta.worker_id, WorkerLoad(r.meta.worker_id, now, i % 4, 512 * (i % 5), i % 7, pool, pool))
        for i, r in enumerate(stream.resyncs)
    ]


def _prompts(stream: Stream, n: int) -> list[list[int]]:
    """Shared prompts with a unique tail each (what the fleet's requests look like)."""
    rng = random.Random(stream.fleet.seed + 1)
    return [list(stream.prompts[i % len(stream.prompts)]) + [rng.randrange(50_000) for _ in range(512)] for i in range(n)]


def measure(s: IngestSettings) -> IngestFigures:
    stream = make_stream(s.fleet, max(s.stream_s, s.duration_s))
    hub_rate, router_rate, applied, consistent = measure_unpaced(stream, s.pull_ms / 1000)
    paced = measure_paced(stream, s)
    d, c = sorted(paced.decide_us), sorted(paced.decide_cpu_us)
    return IngestFigures(
        workers=s.fleet.workers, produced_per_s=stream.page_events / stream.seconds,
        events=stream.page_events, applied=applied, hub_per_s=hub_rate, router_per_s=router_rate,
        consistent=consistent, lag_ms=paced.lag_ms, behind=paced.behind, busy=paced.busy,
        decisions=len(d), decide_us=_p50_p99(d), decide_cpu_us=_p50_p99(c),
    )  # fmt: skip


def _p50_p99(ordered: list[float]) -> tuple[float, float]:
    return (statistics.median(ordered), ordered[int(len(ordered) * 0.99)]) if ordered else (0.0, 0.0)


def table(figures: list[IngestFigures]) -> str:
    headers = ["workers", "produced page ev/s", "hub ev/s (1 core)", "router ev/s (1 core)", "keeps up",
               "paced lag p50 / p99 / max ms", "behind at end", "busy", "decide p50 / p99 µs",
               "decide CPU p50 / p99 µs", "consistent"]  # fmt: skip
    rows = [
        [f.workers, f"{f.produced_per_s:,.0f}", f"{f.hub_per_s:,.0f}", f"{f.router_per_s:,.0f}",
         "yes" if f.keeps_up else "NO", " / ".join(f"{x:.1f}" for x in f.lag_ms), f.behind, f"{f.busy:.2f}",
         f"{f.decide_us[0]:.0f} / {f.decide_us[1]:.0f}", f"{f.decide_cpu_us[0]:.0f} / {f.decide_cpu_us[1]:.0f}",
         "yes" if f.consistent else "NO"]
        for f in figures
    ]  # fmt: skip
    return markdown_table(headers, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = IngestSettings()
    add_fleet_arguments(parser)
    a = parser.add_argument
    a("--stream-s", type=float, default=d.stream_s, help="stream seconds of the unpaced runs")
    a("--duration", type=float, default=d.duration_s, help="seconds of the paced run")
    a("--pull-ms", type=float, default=d.pull_ms)
    a("--decisions", type=float, default=d.decisions, help="decisions/s in the paced run")
    a("--policy", default=d.policy)
    add_output_arguments(parser, "bench_results/index_ingest")


def run(args: argparse.Namespace) -> int:
    fleet = fleet_from_args(args)
    base = IngestSettings(fleet, args.stream_s, args.duration, args.pull_ms, args.decisions, args.policy)
    load_before = load_average()
    figures = []
    for w in args.workers:
        figures.append(measure(replace(base, fleet=replace(fleet, workers=w))))
        print(table(figures[-1:]), flush=True)
    text = f"{table(figures)}\n\n1-minute load average {load_before:.2f} before, {load_average():.2f} after."
    out = prepare_output_dir(args.output_dir)
    write_json(out / "index_ingest.json", {"settings": base, "figures": figures})
    write_text(out / "index_ingest.md", text)
    print(text)
    return 0 if all(f.consistent for f in figures) else 1

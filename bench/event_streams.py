"""Synthetic cache-event streams of a GPU fleet in steady state (`bench.index_ingest`'s input).

Each of W workers prefills `rate` tokens/s at page P and starts with a full cache
(`cache_pages`, registered by a resync). Per engine step (`step_ms`) it publishes one
`EventBatch`:

    STORED        its new pages (rate · step / P of them: a request of `request_pages` pages at a
                  time, every tenth starting with one of a few shared prompts it does not hold)
    SWA_REMOVED   pages its window left behind, a fraction `tombstones` of them (→ TOMBSTONE)
    REMOVED       its oldest pages, as many as keep its cache at `cache_pages`

so each stored page costs about 2 + `tombstones` page events. The generator keeps each worker's
pages as its events leave them, so every event is one a tree makes (the index applies them all).
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerResync
from core.events import CacheEvent, EventKind, PageState, page_hashes
from core.geometry import Geometry

_L, _T = PageState.LIVE, PageState.TOMBSTONE
SHARED_EVERY = 10  # one new request in SHARED_EVERY starts with a shared prompt


@dataclass(frozen=True)
class FleetStream:
    workers: int = 64
    rate: float = 20_000.0  # prefill tokens/s per worker
    page_size: int = 16
    window: int = 128
    step_ms: float = 50.0  # one batch per worker per step
    cache_pages: int = 8192  # each worker's cache, in pages (steady state)
    tombstones: float = 0.5  # SWA_REMOVED pages per stored page
    request_pages: int = 128  # pages of a new request's prompt (2K tokens at page 16)
    shared_prompts: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.workers, self.rate, self.page_size, self.step_ms, self.cache_pages, self.request_pages) <= 0:
            raise ValueError(f"workers, rate, page size, step, cache and request must be positive: {self}")
        if not 0 <= self.tombstones <= 1:
            raise ValueError(f"tombstones must be in [0, 1], got {self.tombstones}")

    @property
    def stored_per_s(self) -> float:
        """Pages the fleet stores per second."""
        return self.workers * self.rate / self.page_size


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet's options, shared by the benchmarks that play a stream (`fleet_from_args`)."""
    f, a = FleetStream(), parser.add_argument
    a("--workers", nargs="+", type=int, default=[8, 32, 64], help="fleet sizes")
    a("--rate", type=float, default=f.rate, help="prefill tokens/s per worker")
    a("--page-size", type=int, default=f.page_size)
    a("--window", type=int, default=f.window)
    a("--step-ms", type=float, default=f.step_ms, help="one batch (push) per worker per step")
    a("--cache-pages", type=int, default=f.cache_pages, help="each worker's cache (pages)")
    a("--tombstones", type=float, default=f.tombstones, help="SWA_REMOVED pages per stored page")
    a("--seed", type=int, default=f.seed)


def fleet_from_args(args: argparse.Namespace) -> FleetStream:
    """`add_fleet_arguments`' options (the fleet size aside: one per `--workers` entry)."""
    return FleetStream(rate=args.rate, page_size=args.page_size, window=args.window, step_ms=args.step_ms,
                       cache_pages=args.cache_pages, tombstones=args.tombstones, seed=args.seed)  # fmt: skip


@dataclass(frozen=True)
class Stream:
    """`seconds` of a fleet's events: the workers' resyncs, then the batches in publication
    order as (stream time s, batch, page events in it); the workers' steps are spread evenly."""

    fleet: FleetStream
    seconds: float
    resyncs: tuple[WorkerResync, ...]
    batches: tuple[tuple[float, EventBatch, int], ...]
    prompts: tuple[tuple[int, ...], ...]  # token ids of the shared prompts

    @property
    def page_events(self) -> int:
        return sum(n for _, _, n in self.batches)

    def until(self, seconds: float) -> int:
        """How many batches are published before `seconds`."""
        return sum(1 for t, _, _ in self.batches if t < seconds)


def make_stream(f: FleetStream, seconds: float) -> Stream:
    rng = random.Random(f.seed)
    prompt_tokens = f.request_pages * f.page_size // 2
    prompts = tuple(tuple(rng.randrange(50_000) for _ in range(prompt_tokens)) for _ in range(f.shared_prompts))
    chains = [page_hashes(p, f.page_size) for p in prompts]
    workers = [_Worker(f"w{i:03d}", f, random.Random(rng.getrandbits(32))) for i in range(f.workers)]
    geometry = Geometry(f.page_size, f.window, 1)
    # NOTE: full_tokens holds twice the cache: the index never evicts for its own bound here.
    resyncs = tuple(
        WorkerResync(WorkerMeta(w.wid, "i", geometry, 2 * f.cache_pages * f.page_size, 1 << 20, True),
                     CacheSnapshot(w.wid, "i", 0, dict(w.pages)))
        for w in workers
    )  # fmt: skip
    step = f.step_ms / 1000
    batches = []
    for k in range(max(1, round(seconds / step))):
        for i, w in enumerate(workers):
            batch, n = w.step(chains)
            batches.append(((k + i / len(workers)) * step, batch, n))
    return Stream(f, seconds, resyncs, tuple(batches), prompts)


class _Worker:
    """One worker's cache as its events leave it, oldest page first."""

    def __init__(self, wid: str, f: FleetStream, rng: random.Random) -> None:
        self.wid, self.f, self.rng = wid, f, rng
        self.pages: OrderedDict[int, PageState] = OrderedDict((rng.getrandbits(63), _L) for _ in range(f.cache_pages))
        self.tail: list[int] = []  # stored pages the window has not left behind yet
        self.request_left = 0
        self.credit = 0.0  # fractional pages carried to the next step
        self.seq = 0

    def step(self, chains: Sequence[list[int]]) -> tuple[EventBatch, int]:
        f = self.f
        self.credit += f.rate * f.step_ms / 1000 / f.page_size
        new = int(self.credit)
        self.credit -= new
        stored = self._new_pages(new, chains)
        self.credit += new - len(stored)  # a shared prompt overshoots: the next steps store less
        for h in stored:
            self.pages[h] = _L
        keep = -(-f.window // f.page_size)  # the window's pages stay LIVE
        self.tail += stored
        behind, self.tail = self.tail[:-keep], self.tail[-keep:]
        tombs = [h for h in behind if self.rng.random() < f.tombstones and self.pages.get(h) is _L]
        for h in tombs:
            self.pages[h] = _T
        removed = list(itertools.islice(self.pages, max(0, len(self.pages) - f.cache_pages)))
        for h in removed:
            del self.pages[h]
        gone = set(removed)
        tombs = [h for h in tombs if h not in gone]
        self.tail = [h for h in self.tail if h not in gone]
        events = [CacheEvent(kind, tuple(pages)) for kind, pages in
                  ((EventKind.STORED, stored), (EventKind.SWA_REMOVED, tombs), (EventKind.REMOVED, removed)) if pages]  # fmt: skip
        self.seq += 1
        return EventBatch(self.wid, "i", self.seq, tuple(events)), len(stored) + len(tombs) + len(removed)

    def _new_pages(self, n: int, chains: Sequence[list[int]]) -> list[int]:
        stored: list[int] = []
        while len(stored) < n:
            if self.request_left <= 0:  # a new request
                self.request_left = self.f.request_pages
                if self.rng.randrange(SHARED_EVERY) == 0:
                    shared = [h for h in self.rng.choice(chains) if h not in self.pages and h not in stored]
                    stored += shared
                    self.request_left -= len(shared)
                    continue
            stored.append(self.rng.getrandbits(63))
            self.request_left -= 1
        return stored

"""Measure one routing decision: `python -m bench.decision_latency [--workers 64 --prompt 4096]`.

Worst case on purpose: every worker holds the prompt's whole prefix (so the walk goes to the
last page with all bits alive), a third of them with tombstones in the window tail (so the
valid-match fallback runs), each with thousands of unrelated pages, and every worker reports
load. `cold` hashes the prompt for the first time; `warm` finds its pages in the hash memo
(what a shared prefix costs from its second request on).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, PoolHeadroom, WorkerLoad, WorkerMeta, WorkerResync
from core.events import PageState, page_hashes
from core.geometry import Geometry
from router.core import Candidate, RouterCore
from router.policies import make_policy


@dataclass(frozen=True)
class LatencyReport:
    workers: int
    prompt_tokens: int
    page_size: int
    cold_us: tuple[float, float, float]  # min, p50, p99
    warm_us: tuple[float, float, float]

    def __str__(self) -> str:
        def row(name: str, q: tuple[float, float, float]) -> str:
            return f"  {name:<28} min {q[0]:7.1f} us   p50 {q[1]:7.1f} us   p99 {q[2]:7.1f} us"

        return "\n".join(
            [
                f"swa_prefix decision, {self.workers} workers, {self.prompt_tokens}-token "
                f"prompt, page {self.page_size}",
                row("cold (prompt hashed now)", self.cold_us),
                row("warm (pages in hash memo)", self.warm_us),
            ]
        )


def _index(prompt: list[int], workers: int, page_size: int, noise_pages: int) -> ClusterIndex:
    chain = page_hashes(prompt[:-1], page_size)
    rng = random.Random(0)
    index = ClusterIndex()
    for w in range(workers):
        pages = {h: PageState.LIVE for h in chain}
        if w % 3 == 0:  # tombstoned window tail: valid match falls back
            for h in chain[-3:]:
                pages[h] = PageState.TOMBSTONE
        for _ in range(noise_pages):
            pages[rng.getrandbits(63)] = PageState.LIVE
        wid = f"w{w:03d}"
        meta = WorkerMeta(wid, "i", Geometry(page_size, 4 * page_size), 1 << 22, 1 << 20, True)
        index.resync(WorkerResync(meta, CacheSnapshot(wid, "i", 0, pages)))
    return index


def _candidates(workers: int) -> list[Candidate]:
    pool = PoolHeadroom(1 << 20, 1 << 18, 1 << 22)
    return [
        Candidate(
            f"w{w:03d}",
            WorkerLoad(f"w{w:03d}", time.time(), w % 4, 512 * (w % 5), w % 7, pool, pool),
        )
        for w in range(workers)
    ]


def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(samples, n=100)
    return min(samples) * 1e6, qs[49] * 1e6, qs[98] * 1e6


def _timed(decide: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        decide()
        out.append(time.perf_counter() - t0)
    return out


def measure(
    workers: int = 64, prompt_tokens: int = 4096, page_size: int = 16, rounds: int = 300
) -> LatencyReport:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    index = _index(prompt, workers, page_size, noise_pages=2000)
    cands = _candidates(workers)
    cold_cores = [RouterCore(index, make_policy()) for _ in range(rounds)]  # empty hash memos
    it = iter(cold_cores)
    cold = _timed(lambda: next(it).decide(prompt, cands), rounds)
    warm_core = RouterCore(index, make_policy())
    warm_core.decide(prompt, cands)
    warm = _timed(lambda: warm_core.decide(prompt, cands), rounds)
    return LatencyReport(workers, prompt_tokens, page_size, _quantiles(cold), _quantiles(warm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    print(measure(args.workers, args.prompt, args.page_size, args.rounds))


if __name__ == "__main__":
    main()

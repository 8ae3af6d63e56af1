"""Measure one routing decision: `python -m router.decision_latency [--workers 64 --prompt 4096]`.

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
from dataclasses import dataclass

from cluster.index import ClusterIndex
from cluster.load import PoolHeadroom, WorkerLoad
from cluster.messages import WorkerResync
from router.core import Candidate, RouterCore
from router.policies import make_policy
from worker.protocol import CacheSnapshot, PageState, WorkerMeta, page_hashes


@dataclass(frozen=True)
class LatencyReport:
    workers: int
    prompt_tokens: int
    page_size: int
    cold_us: tuple[float, float]  # p50, p99
    warm_us: tuple[float, float]

    def __str__(self) -> str:
        return (
            f"{self.policy_line()}\n"
            f"  cold (prompt hashed now):   p50 {self.cold_us[0]:7.1f} us   p99 {self.cold_us[1]:7.1f} us\n"
            f"  warm (pages in hash memo):  p50 {self.warm_us[0]:7.1f} us   p99 {self.warm_us[1]:7.1f} us"
        )

    def policy_line(self) -> str:
        return (
            f"swa_prefix decision, {self.workers} workers, {self.prompt_tokens}-token prompt, "
            f"page {self.page_size}"
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
        meta = WorkerMeta(wid, "i", page_size, 4 * page_size, 1 << 22, 1 << 20, True)
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


def _percentiles(samples: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(samples, n=100)
    return qs[49] * 1e6, qs[98] * 1e6


def measure(
    workers: int = 64, prompt_tokens: int = 4096, page_size: int = 16, rounds: int = 300
) -> LatencyReport:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    core = RouterCore(_index(prompt, workers, page_size, noise_pages=2000), make_policy())
    cands = _candidates(workers)
    cold, warm = [], []
    for _ in range(rounds):
        fresh = RouterCore(core.index, make_policy())  # empty hash memo
        t0 = time.perf_counter()
        fresh.decide(prompt, cands)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        core.decide(prompt, cands)
        warm.append(time.perf_counter() - t0)
    return LatencyReport(workers, prompt_tokens, page_size, _percentiles(cold), _percentiles(warm))


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

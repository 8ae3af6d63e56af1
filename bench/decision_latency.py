"""Measure one routing decision: `python -m bench.decision_latency [--workers 64 --prompt 4096]`.

Worst case on purpose: every worker holds the prompt's whole prefix (so the walk goes to the
last page with all bits alive), a third of them with tombstones in the window tail (so the
valid-match fallback runs), each with thousands of unrelated pages, and every worker reports
load. `cold` hashes the prompt for the first time; `warm` finds its pages in the hash memo
(what a shared prefix costs from its second request on).

Three fleets, timed in alternation so all see the same machine load:

- `off`: no worker has a host tier (`WorkerMeta.tier_costs` None), every page on the device;
- `on`: every worker has a host tier and a quarter of its unrelated pages there (what tracking
  tiers costs: the walk reads four bitsets per page, the index holds host states), the prompt's
  pages as in `off`;
- `on, prompt on host`: as `on`, and two thirds of the workers hold part of the prompt on the
  host (what pricing loads costs): a third with a leaf-side stretch offloaded (HOST: a load
  priced by `choose_reuse`), a third with interior SWA there (SWA_HOST before a LIVE window),
  at depths that differ per worker.

The issue's bound: the decision with tiers on stays within 10 % of the same run with them off.

Every policy in a simulated fleet with real traffic: `python -m bench.routing.policy_latency`.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, PoolHeadroom, WorkerLoad, WorkerMeta, WorkerResync
from core.events import PageState, page_hashes
from core.geometry import Geometry
from core.reuse import TierCosts
from router.core import Candidate, RouterCore
from router.policies import make_policy

# GPT-OSS-120B-like per-token costs (seconds): H200 prefill, PCIe Gen5 loads (docs/design.md §9.9).
TIER_COSTS = TierCosts(prefill=2 * 5.1e9 / 400e12, load_full=36_864 / 50e9, load_swa=36_864 / 50e9)

Quantiles = tuple[float, float, float]  # min, p50, p99 in µs


@dataclass(frozen=True)
class LatencyReport:
    workers: int
    prompt_tokens: int
    page_size: int
    cold_us: dict[str, Quantiles]  # fleet (`FLEETS`) → quantiles
    warm_us: dict[str, Quantiles]

    def ratio(self, fleet: str, which: str, q: int) -> float:
        """`fleet` / off, of quantile `q` (0 min, 1 p50, 2 p99) of `which` (cold, warm)."""
        table = self.cold_us if which == "cold" else self.warm_us
        return table[fleet][q] / table["off"][q]

    def __str__(self) -> str:
        def row(name: str, q: Quantiles) -> str:
            return f"  {name:<34} min {q[0]:7.1f} us   p50 {q[1]:7.1f} us   p99 {q[2]:7.1f} us"

        lines = [
            f"swa_prefix decision, {self.workers} workers, {self.prompt_tokens}-token "
            f"prompt, page {self.page_size}"
        ]
        for which, table in (("cold", self.cold_us), ("warm", self.warm_us)):
            for fleet in FLEETS:
                lines.append(row(f"{which}, tiers {fleet}", table[fleet]))
        for fleet in FLEETS[1:]:
            for which in ("cold", "warm"):
                lines.append(
                    f"  tiers {fleet} / off, {which}: min {self.ratio(fleet, which, 0):.3f}  p50 "
                    f"{self.ratio(fleet, which, 1):.3f}  p99 {self.ratio(fleet, which, 2):.3f}"
                )
        return "\n".join(lines)


FLEETS = ("off", "on", "on, prompt on host")


def _states(chain: list[int], w: int, prompt_on_host: bool) -> dict[int, PageState]:
    pages = {h: PageState.LIVE for h in chain}
    n = len(chain)
    if w % 3 == 0:  # tombstoned window tail: valid match falls back
        for h in chain[-3:]:
            pages[h] = PageState.TOMBSTONE
    elif prompt_on_host and w % 3 == 1:  # a leaf-side stretch offloaded: a load
        for h in chain[n // 2 + w % 16 :]:
            pages[h] = PageState.HOST
    elif prompt_on_host:  # interior SWA on the host, the window before the end LIVE
        for h in chain[n // 4 + w % 16 : -8]:
            pages[h] = PageState.SWA_HOST
    return pages


def _index(prompt: list[int], workers: int, page_size: int, noise_pages: int, fleet: str) -> ClusterIndex:
    chain = page_hashes(prompt[:-1], page_size)
    rng = random.Random(0)
    index = ClusterIndex()
    tiers = fleet != "off"
    for w in range(workers):
        pages = _states(chain, w, fleet == FLEETS[2])
        for i in range(noise_pages):
            pages[rng.getrandbits(63)] = PageState.HOST if tiers and i % 4 == 0 else PageState.LIVE
        wid = f"w{w:03d}"
        costs = TIER_COSTS if tiers else None
        meta = WorkerMeta(wid, "i", Geometry(page_size, 4 * page_size, 18), 1 << 22, 1 << 20, True,
                          True, costs, 1 << 23 if tiers else 0)  # fmt: skip
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


def _quantiles(samples: list[float]) -> Quantiles:
    qs = statistics.quantiles(samples, n=100)
    return min(samples) * 1e6, qs[49] * 1e6, qs[98] * 1e6


def _timed(decide: dict[str, Callable[[], object]], rounds: int) -> dict[str, Quantiles]:
    """Alternate the fleets' decisions (off, on, …, off, on, …) so all see the same load."""
    out: dict[str, list[float]] = {k: [] for k in decide}
    for _ in range(rounds):
        for name, fn in decide.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return {k: _quantiles(v) for k, v in out.items()}


def _deciding(cores: Iterator[RouterCore], prompt: list[int], cands: list[Candidate]) -> Callable[[], object]:
    """One decision per call, each by the next core (fresh ones: cold; the same one: warm)."""
    return lambda: next(cores).decide(prompt, cands)


def measure(
    workers: int = 64, prompt_tokens: int = 4096, page_size: int = 16, rounds: int = 300
) -> LatencyReport:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    cands = _candidates(workers)
    indexes = {f: _index(prompt, workers, page_size, 2000, f) for f in FLEETS}
    cold_cores = {f: iter([RouterCore(ix, make_policy()) for _ in range(rounds)]) for f, ix in indexes.items()}
    cold = _timed({f: _deciding(it, prompt, cands) for f, it in cold_cores.items()}, rounds)
    warm_cores = {f: RouterCore(ix, make_policy()) for f, ix in indexes.items()}
    for core in warm_cores.values():
        core.decide(prompt, cands)
    warm = _timed({f: _deciding(itertools.repeat(c), prompt, cands) for f, c in warm_cores.items()}, rounds)
    return LatencyReport(workers, prompt_tokens, page_size, cold, warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[64])
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    for workers in args.workers:
        print(measure(workers, args.prompt, args.page_size, args.rounds))


if __name__ == "__main__":
    main()

"""The cost model: prefill saved against load and both pools' capacity, in tokens of work.

For a request of `prompt` tokens and a worker w that would reuse `cached` of them:

    cost(w) = prefill · (prompt − cached)                     tokens this request must compute
            + prefill · host_load(w)                          its KV loaded from the host tier
            + queued_prefill · queued_prefill_tokens(w)       prefill queued ahead of it
            + decode · running_decodes(w)                     decodes sharing every step
            + shortfall · Σ_pool max(0, need − (free + evictable))   cannot fit now: waits
            + eviction  · Σ_pool max(0, min(need, free + evictable) − free)   evicts cached KV

Lowest cost wins. The first three terms approximate time to first token (the queue ahead plus
our own prefill), as Dynamo's cost does; the last two keep requests off workers whose pools are
full (a shortfall stalls the request) or full of useful cache (eviction costs future hits).
Pool needs mirror the worker's admission charge (docs/design.md §11.3): full pool
`uncached + max_new_tokens`, SWA pool `max(uncached, window) + page_size` on hybrid workers
(`repaired + max(uncached − repaired, window) + page_size` through a repair), plus what a load
brings back (`loaded_full`, `loaded_swa`: device slots it takes). `cached` is what the worker
skips: with a repair (docs/design.md §9.8) its rows count as compute, in `uncached`; with a load
(§9.9) the loaded tokens are cached, and `host_load` prices their copy in tokens of prefill
(`TierCosts`: loaded_full · load_full + loaded_swa · load_swa, over prefill). Without a host tier
`host_load` is 0 and the model is what it always was.

Load counts come from the worker's last `record_routing_stats` sample (≈1 s old) plus what this
router routed there after that sample, minus what it saw complete there that the sample still
holds (`extra_*`, `router/inflight.py`), so a burst does not pile onto one worker between two
samples, a finished request does not keep weighing on its worker, and each router sees the
worker's whole load, not just its own 1/N.

Imbalance guard: a worker whose load exceeds the lightest by more than `imbalance_abs_tokens`
*and* `imbalance_rel`× is ranked after every other worker. It is per worker (the others keep
their prefix affinity), unlike routers whose fleet-wide imbalance test switches affinity off
for everyone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cluster.messages import PoolHeadroom, WorkerLoad
from core.geometry import Geometry

# A worker the index does not know: nothing matched, no window to charge.
UNKNOWN_GEOMETRY = Geometry(page_size=1, window=None)


@dataclass(frozen=True)
class CostWeights:
    prefill: float = 1.0  # per uncached prompt token
    queued_prefill: float = 1.0  # per queued prefill token on the worker
    decode: float = 16.0  # token-equivalents per running decode
    shortfall: float = 4.0  # per token a pool cannot provide even after evicting
    eviction: float = 0.25  # per cached token the request would evict
    imbalance_abs_tokens: float = 4096.0
    imbalance_rel: float = 2.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in dataclasses.asdict(self).items() if v < 0}
        if bad:
            raise ValueError(f"cost weights must be >= 0, got {bad}")


class WorkerView(NamedTuple):
    """Everything a policy may know about one candidate for one request.

    NOTE: a NamedTuple (immutable, and twice as cheap to build as a frozen dataclass): one is
    built per candidate per request.
    """

    worker_id: str
    # Tokens the worker will reuse: its window-valid match, or where its repair starts
    # (core/reuse.py, docs/design.md §9.8); `repaired` tokens after it are recomputed.
    valid_cached: int
    full_cached: int  # tokens with full KV present (what SWA-unaware routers count)
    load: WorkerLoad | None  # None: the replica has not reported yet
    # Routed here by this router after the load sample, minus its completions since of requests
    # the sample includes (router/inflight.py); may be negative.
    extra_prefill_tokens: int = 0
    extra_requests: int = 0
    geometry: Geometry = UNKNOWN_GEOMETRY
    hybrid: bool = False
    repaired: int = 0  # repair rows the worker would recompute before `full_cached`
    # Of `valid_cached`, tokens whose full / SWA KV the worker loads from its host tier first,
    # and what those copies cost in tokens of prefill (core/reuse.py `TierCosts`).
    loaded_full: int = 0
    loaded_swa: int = 0
    host_load_cost: float = 0.0


def load_tokens(view: WorkerView, w: CostWeights) -> float:
    """Work queued ahead of a new request on this worker, in token-equivalents."""
    queued, decodes = view.extra_prefill_tokens, view.extra_requests
    if view.load is not None:
        queued += view.load.queued_prefill_tokens
        decodes += view.load.running_decodes
    # A credit (negative extra) takes back a completed request's prefill *and* decode, of which
    # the sample holds one (router/inflight.py): each count stops at 0.
    queued = queued if queued > 0 else 0
    decodes = decodes if decodes > 0 else 0
    return w.queued_prefill * queued + w.decode * decodes


def capacity_tokens(view: WorkerView, uncached: int, max_new_tokens: int, w: CostWeights) -> float:
    """Shortfall and eviction penalties of placing the request's KV in both pools."""
    if view.load is None:
        return 0.0
    claimed = view.extra_prefill_tokens if view.extra_prefill_tokens > 0 else 0
    cost = _pool_cost(uncached + max_new_tokens + view.loaded_full, view.load.full, claimed, w)
    if view.hybrid:
        geometry = view.geometry
        window = geometry.window or 0
        # A repair's rows take scratch SWA slots at once (the worker's repair_swa_charge); loaded
        # SWA KV takes device slots too.
        rest = uncached - view.repaired
        need_swa = view.repaired + (rest if rest > window else window) + geometry.page_size
        cost += _pool_cost(need_swa + view.loaded_swa, view.load.swa, claimed, w)
    return cost


def request_cost(
    view: WorkerView,
    cached: int,
    prompt_tokens: int,
    max_new_tokens: int,
    w: CostWeights,
    load: float | None = None,
    host_load: float = 0.0,
) -> float:
    """The cost model above for one worker (`load`: a precomputed `load_tokens`; `host_load`:
    the tier copies the policy believes in, in tokens of prefill)."""
    uncached = prompt_tokens - cached if prompt_tokens > cached else 0
    if load is None:
        load = load_tokens(view, w)
    compute = uncached + host_load
    return w.prefill * compute + load + capacity_tokens(view, uncached, max_new_tokens, w)


def overloaded(loads: Sequence[float], w: CostWeights) -> list[bool]:
    """Per worker: is its load (`load_tokens`) past the imbalance guard, relative to the
    lightest worker?"""
    if not loads:
        return []
    floor = min(loads)
    return [
        load - floor > w.imbalance_abs_tokens and load > w.imbalance_rel * floor for load in loads
    ]


def _pool_cost(need: int, pool: PoolHeadroom, claimed: int, w: CostWeights) -> float:
    # Conditional expressions instead of max(): this runs twice per candidate per request.
    free = pool.free - claimed
    free = free if free > 0 else 0
    allocatable = pool.free + pool.evictable - claimed
    allocatable = allocatable if allocatable > 0 else 0
    shortfall = need - allocatable if need > allocatable else 0
    evicted = need - shortfall - free  # what fits beyond `free` evicts cached KV
    evicted = evicted if evicted > 0 else 0
    return w.shortfall * shortfall + w.eviction * evicted

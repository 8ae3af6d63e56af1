"""Admission math for hybrid SWA (docs/design.md §11.3), as pure functions, and the stall guard
(the request refused when two steps in a row schedule nothing).

The scheduler keeps the running budgets (`rem_total` over the full pool, `rem_swa` over the SWA
pool, both = available + evictable - what admitted requests will still take) and asks these
functions what one request costs. W is the window (keys to the left), P the page size: the
SWA charges take the worker's `Geometry`, whose window must be set (an SWA pool exists).

    SWA pool, one request being prefilled, then decoding:

    |<-- dead: freed out of window -->|<------ W ------>|<- interval ->|<- P ->|
                                       keys the next query still sees  frees run  decode page
                                                                       every
                                                                       `interval`
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.geometry import Geometry, ceil_page

if TYPE_CHECKING:
    from worker.cache.base import PrefixCache
    from worker.kv.hybrid_allocator import HybridAllocator
    from worker.scheduler.plan import SchedulerLimits
    from worker.scheduler.request import Req


def _window(g: Geometry) -> int:
    assert g.window is not None, "an SWA charge without a window (no SWA pool to budget)"
    return g.window


def swa_admission_charge(extend_len: int, chunk_budget: int | None, g: Geometry) -> int:
    """SWA tokens one admitted extend is charged: max(min(e, c), W) + P.

    Only this step's chunk is new (earlier chunks and locked windows are already out of
    available + evictable); the W floor reserves the window a decoding request keeps, and P the
    page its next decode token may open. `chunk_budget` None: no chunking, the whole extend.
    """
    alloc = extend_len if chunk_budget is None else min(extend_len, chunk_budget)
    return max(alloc, _window(g)) + g.page_size


def repair_swa_charge(chunk: int, rows: int, g: Geometry) -> int:
    """SWA tokens a repairing admission is charged (docs/design.md §9.8): its `rows` scratch
    slots, taken at once, plus `swa_admission_charge` for the part of the first `chunk` past
    them: rows + max(chunk − rows, W) + P."""
    return rows + max(chunk - rows, _window(g)) + g.page_size


def full_admission_charge(extend_len: int, max_new_tokens: int, page_size: int) -> int:
    """Full-pool tokens one request is charged: ceil_P(e) + max_new_tokens + P.

    With max_new_tokens=0 this is the `cur_rem` charge ceil_P(e) + P (what it holds right now).
    """
    return ceil_page(extend_len, page_size) + max_new_tokens + page_size


def full_admits(extend_len: int, max_new_tokens: int, page_size: int, rem_total: int) -> bool:
    """The full-pool admission test: reject (no token) when e + max_new + P >= rem_total."""
    return extend_len + max_new_tokens + page_size < rem_total


def chunk_cap(rem_swa: int, g: Geometry) -> int:
    """Largest first chunk when the whole extend's SWA charge does not fit: floor_P(rem_swa - W - P).

    The escape hatch for prompts larger than the SWA pool (no head-of-line livelock). A result
    <= 0 means no room: reject now (or if chunking is disabled).
    """
    return g.floor(rem_swa - _window(g) - g.page_size)


def first_chunk_len(
    extend_len: int, chunk_budget: int, rem_swa: int, g: Geometry, *, alone: bool
) -> int:
    """First chunk of an admitted extend under the SWA budget; <= 0: not now.

    The whole `min(e, chunk)` when its charge fits; else the escape hatch (no head-of-line
    livelock) `chunk_cap`. NOTE: alone, nothing will ever free more (unlocked tree KV already
    counts as evictable) and the matched prefix's SWA lock covers whole nodes, so reserving W
    of headroom on top would stall the queue forever: take what the pool physically holds
    (one page kept for the allocation, as for a continuing chunk).
    """
    n = min(extend_len, chunk_budget)
    if swa_admission_charge(extend_len, chunk_budget, g) < rem_swa:
        return n
    cap = chunk_cap(rem_swa, g)
    if cap <= 0 and alone:
        cap = rem_swa - g.page_size
    return min(n, cap) if cap > 0 else 0


def continuing_chunk_len(
    rem_chunk: int, remaining: int, rem_swa: int | None, page_size: int
) -> int:
    """Length of the next chunk of an unfinished prefill: min(rem_chunk, remaining, rem_swa - P).

    `rem_chunk`: the step's prefill budget left; `remaining`: tokens the request still has to
    feed. The full pool is not budgeted here: the chunk's pages are taken (evicting the tree if
    needed) when it is allocated. NOTE: a result <= 0 under hybrid SWA means *defer*: the
    request waits, unscheduled and not stashed (stashing a chunk that was not scheduled
    double-frees). `rem_swa` None: no SWA pool (non-hybrid), the SWA term drops out.
    """
    n = min(rem_chunk, remaining)
    return n if rem_swa is None else min(n, rem_swa - page_size)


def future_tokens(req: Req, clip: int) -> int:
    """Decode tokens a running request is assumed to still need (at most `clip`)."""
    return min(max(req.params.max_tokens - req.generated, 0), clip)


def full_budget(allocator: HybridAllocator, cache: PrefixCache, running: list[Req], clip: int) -> int:
    """Full-pool budget: available + evictable − what the running requests will still take."""
    pending = sum(future_tokens(r, clip) + r.remaining for r in running)
    return allocator.full_available_size() + cache.full_evictable - pending


def swa_budget(
    allocator: HybridAllocator, cache: PrefixCache, running: list[Req], limits: SchedulerLimits
) -> int:
    """SWA-pool budget: available + evictable − a decoding request's headroom (interval + P)."""
    headroom = limits.swa_eviction_interval + limits.geometry.page_size
    pending = sum(headroom for r in running if r.generated)
    return allocator.swa_available_size() + cache.swa_evictable - pending

# ---- the stall guard ------------------------------------------------------------------------
# Scheduling is deterministic and only a forward or an abort frees memory, so two steps in a row
# that schedule nothing while requests exist will repeat forever. The newest request is refused
# with a clear error instead of hanging (e.g. an SWA pool barely above W + P whose window locks
# leave a lone request no room).


class StallGuard:
    def __init__(self) -> None:
        self._idle_steps = 0  # consecutive steps that scheduled nothing while requests existed

    def victim(self, progressed: bool, running: Sequence[Req], waiting: Sequence[Req]) -> Req | None:
        """The request to refuse after this step, if scheduling is stuck."""
        if progressed or not (running or waiting):
            self._idle_steps = 0
            return None
        self._idle_steps += 1
        if self._idle_steps < 2:
            return None
        self._idle_steps = 0
        return running[-1] if running else waiting[0]


def stall_error(a: HybridAllocator, limits: SchedulerLimits) -> str:
    g = limits.geometry
    return (
        f"the KV pools cannot hold this request's next step (full pool {a.full_size} tokens, "
        f"SWA pool {a.swa_size} tokens, window {g.window}, page {g.page_size}); raise "
        "swa_full_tokens_ratio or the KV budget, or lower chunked_prefill_size"
    )

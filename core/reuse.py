"""What a request reuses from a cached prefix, and what it recomputes to repair it (docs/design.md §9.8).

One pure, torch-free rule shared by the worker's scheduler and the router (which imports it the
way it mirrors the window rule), so the router's prediction is the worker's decision.

Inputs: `p_full`, the tokens whose FULL KV is cached (tombstones included), and `p_valid`, the
window-valid match (docs/design.md §1). When a tombstone makes `p_valid < p_full`, the SWA KV the
next query needs can be rebuilt exactly from the cached full KV by recomputing the `R` tokens
before `p_full` (the *repair rows*), with

    R = ceil_P(ceil_P(W) + (n_swa − 1) · W)

W the window, n_swa the number of SWA layers, P the page size. Why this is exact: the j-th SWA
layer's KV at position q depends on the window before q at that layer's input; the layers below
the first SWA layer are full layers that read the cached (exact) full KV, so a recompute that
starts at `start` gives the first SWA layer exact KV from `start` on, and each SWA layer above
loses W positions at the front (full layers in between lose none: they read cached KV). So SWA
layer j is exact from `start + (j − 1) · W`, all n_swa layers from `start + (n_swa − 1) · W`. The
pages revived afterwards, `[p_full − ceil_P(W), p_full)`, are then exact at every SWA layer when
`start ≤ p_full − ceil_P(W) − (n_swa − 1) · W`, and rounding up to a page keeps `start` aligned.

    positions  0 ......... start ............................ p_full − ceil_P(W) ...... p_full
               | reused (skipped) |<------------ R repair rows (recomputed) ----------------->|
                                                              |<- revived tail, exact SWA ->|

A repair runs only when it is cheaper than recomputing from `p_valid`: `R ≤ (p_full − p_valid)/2`
(it then computes at most half of what it saves).

With a host tier (docs/design.md §9.9) a page's full and SWA KV may sit on the host instead of
the device, and a prefix has three ways to be used, priced per token (`TierCosts`):

- **load**: reuse the window-valid match over device ∪ host SWA (`p_valid`), loading the host's
  full KV of `[0, p_valid)` and its SWA KV of the window before `p_valid`;
- **repair**: reuse `p_full − R`, loading the host's full KV of `[0, p_full)` and recomputing R;
- **recompute**: reuse only `p_device`, the valid match that needs no load.

`choose_reuse` takes the cheapest (ties: fewer loads, no repair); without a host tier it is the
repair rule above exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from core.events import PageState
from core.geometry import Geometry

REPAIR_WEIGHT = 2  # a repair row is priced as two computed tokens: R <= gap / 2 (see above)


class Reuse(NamedTuple):
    """How a prompt's cached prefix is used. `reused` tokens are skipped (the response's
    `cached_tokens`; loaded ones included); the next `repaired` tokens are recomputed only to
    rebuild SWA KV. `loaded_full` / `loaded_swa`: tokens whose full / SWA KV comes back from
    the host tier first."""

    reused: int
    repaired: int = 0
    loaded_full: int = 0
    loaded_swa: int = 0

    @property
    def compute_start(self) -> int:
        """The first position the forward computes (= `reused`)."""
        return self.reused


def repair_rows(g: Geometry) -> int:
    """R = ceil_P(ceil_P(W) + (n_swa − 1)·W): tokens recomputed before `p_full` (see above)."""
    if g.window is None or g.window < 1 or g.swa_layers < 1:
        raise ValueError(f"repair needs window >= 1 and >= 1 SWA layer, got {g.window}, {g.swa_layers}")
    return g.ceil(g.ceil(g.window) + (g.swa_layers - 1) * g.window)


def plan_reuse(p_full: int, p_valid: int, g: Geometry, *, repair: bool) -> Reuse:
    """(reused, repaired) for one prompt on one worker without a host tier (both page-aligned).

    Repair when it is enabled, the worker has SWA layers with a window, the full match runs past
    the valid one, and `R ≤ (p_full − p_valid) / 2`; otherwise reuse the valid match.
    """
    if not repair or not g.slides or p_full <= p_valid:
        return Reuse(p_valid)
    rows = repair_rows(g)
    if REPAIR_WEIGHT * rows > p_full - p_valid:
        return Reuse(p_valid)
    return Reuse(p_full - rows, rows)


@dataclass(frozen=True, slots=True)
class TierCosts:
    """What one token costs a worker, in seconds: computing it in a prefill, and loading its
    full / SWA KV (every layer of that kind) from the host tier."""

    prefill: float
    load_full: float
    load_swa: float


class TieredMatch(NamedTuple):
    """One worker's match of a prompt across tiers (tokens, page-aligned; `tiered_match`)."""

    p_full: int  # full KV cached on either tier from the root, tombstones included
    p_valid: int  # window-valid over device ∪ host SWA
    p_device: int  # window-valid with nothing loaded (full and window SWA on the device)
    host_full: int  # tokens of [0, p_valid) whose full KV is on the host
    host_swa: int  # tokens of the window before p_valid whose SWA KV is on the host
    host_full_all: int  # tokens of [0, p_full) whose full KV is on the host (a repair loads them)


def choose_reuse(m: TieredMatch, g: Geometry, costs: TierCosts, *, repair: bool) -> Reuse:
    """The cheapest of recompute / load / repair for one prompt on one worker (see above).

    Cost = computed tokens × prefill + loaded tokens × their load cost, each repair row priced
    `REPAIR_WEIGHT` times (so without a host tier this is `plan_reuse` exactly); ties go to
    fewer loads, then to the repair (as `plan_reuse` does)."""
    c = costs
    best, best_cost = Reuse(m.p_device), -m.p_device * c.prefill
    if m.p_valid > m.p_device:
        cost = -m.p_valid * c.prefill + m.host_full * c.load_full + m.host_swa * c.load_swa
        if cost < best_cost:
            best, best_cost = Reuse(m.p_valid, 0, m.host_full, m.host_swa), cost
    if repair and g.slides and m.p_full > m.p_valid:
        rows = repair_rows(g)
        cost = (REPAIR_WEIGHT * rows - m.p_full) * c.prefill + m.host_full_all * c.load_full
        if cost <= best_cost:
            best = Reuse(m.p_full - rows, rows, m.host_full_all, 0)
    return best


def tiered_match(states: Sequence[PageState | None], g: Geometry) -> TieredMatch:
    """The reference walk: `TieredMatch` from the states of a prompt's pages on one worker, in
    chain order (None: the page is absent; the walk stops there). The tree and the router's
    index compute the same numbers their own way; tests hold them to this."""
    P, W = g.page_size, g.window
    present = 0
    while present < len(states) and states[present] is not None:
        present += 1
    pages = [s for s in states[:present] if s is not None]
    valid = _deepest_valid(pages, P, W, lambda s: s.has_swa, lambda s: True)
    device = _deepest_valid(pages, P, W, lambda s: s is PageState.LIVE, lambda s: not s.full_on_host)
    host_full = sum(P for s in pages[:valid] if s.full_on_host)
    host_full_all = sum(P for s in pages if s.full_on_host)
    tail = 0 if W is None else g.ceil(W) // P
    host_swa = sum(P for s in pages[max(0, valid - tail) : valid] if s.swa_on_host)
    return TieredMatch(present * P, valid * P, device * P, host_full, host_swa, host_full_all)


def _deepest_valid(pages: list[PageState], P: int, window: int | None, live, usable) -> int:  # type: ignore[no-untyped-def]
    """Largest k such that pages [0, k) are all `usable` and, if any of them is not `live`, the
    live run ending at page k - 1 covers `window` tokens."""
    best, run, tomb = 0, 0, False
    for k, s in enumerate(pages, start=1):
        if not usable(s):
            break
        if live(s):
            run += P
        else:
            run, tomb = 0, True
        if window is None or not tomb or run >= window:
            best = k
    return best


def live_after(reuse: Reuse, p_full: int, g: Geometry) -> int:
    """Where the pages a request leaves LIVE begin once it has run: a repair revives only the
    tail `[p_full − ceil_P(W), p_full)` (the tombstones before it stay), everything else from
    the compute start on is (re)computed and inserted live."""
    if not reuse.repaired or g.window is None:
        return reuse.compute_start
    return p_full - g.ceil(g.window)

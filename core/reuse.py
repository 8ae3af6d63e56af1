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
"""

from __future__ import annotations

from typing import NamedTuple

from core.geometry import Geometry


class Reuse(NamedTuple):
    """How a prompt's cached prefix is used. `reused` tokens are skipped (the response's
    `cached_tokens`); the next `repaired` tokens are recomputed only to rebuild SWA KV."""

    reused: int
    repaired: int = 0

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
    """(reused, repaired) for one prompt on one worker (both page-aligned).

    Repair when it is enabled, the worker has SWA layers with a window, the full match runs past
    the valid one, and `R ≤ (p_full − p_valid) / 2`; otherwise reuse the valid match.
    """
    if not repair or not g.slides or p_full <= p_valid:
        return Reuse(p_valid)
    rows = repair_rows(g)
    if 2 * rows > p_full - p_valid:
        return Reuse(p_valid)
    return Reuse(p_full - rows, rows)


def live_after(reuse: Reuse, p_full: int, g: Geometry) -> int:
    """Where the pages a request leaves LIVE begin once it has run: a repair revives only the
    tail `[p_full − ceil_P(W), p_full)` (the tombstones before it stay), everything else from
    the compute start on is (re)computed and inserted live."""
    if not reuse.repaired or g.window is None:
        return reuse.compute_start
    return p_full - g.ceil(g.window)

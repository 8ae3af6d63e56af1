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

from worker.kv.pages import ceil_page


class Reuse(NamedTuple):
    """How a prompt's cached prefix is used. `reused` tokens are skipped (the response's
    `cached_tokens`); the next `repaired` tokens are recomputed only to rebuild SWA KV."""

    reused: int
    repaired: int = 0

    @property
    def compute_start(self) -> int:
        """The first position the forward computes (= `reused`)."""
        return self.reused


def repair_rows(window: int, swa_layers: int, page_size: int) -> int:
    """R = ceil_P(ceil_P(W) + (n_swa − 1)·W): tokens recomputed before `p_full` (see above)."""
    if window < 1 or swa_layers < 1:
        raise ValueError(f"repair needs window >= 1 and >= 1 SWA layer, got {window}, {swa_layers}")
    return ceil_page(ceil_page(window, page_size) + (swa_layers - 1) * window, page_size)


def plan_reuse(
    p_full: int,
    p_valid: int,
    *,
    window: int | None,
    swa_layers: int,
    page_size: int,
    repair: bool,
) -> Reuse:
    """(reused, repaired) for one prompt on one worker (both page-aligned).

    Repair when it is enabled, the worker has SWA layers with a window, the full match runs past
    the valid one, and `R ≤ (p_full − p_valid) / 2`; otherwise reuse the valid match.
    """
    if not repair or window is None or swa_layers < 1 or p_full <= p_valid:
        return Reuse(p_valid)
    rows = repair_rows(window, swa_layers, page_size)
    if 2 * rows > p_full - p_valid:
        return Reuse(p_valid)
    return Reuse(p_full - rows, rows)


def live_after(reuse: Reuse, p_full: int, window: int | None, page_size: int) -> int:
    """Where the pages a request leaves LIVE begin once it has run: a repair revives only the
    tail `[p_full − ceil_P(W), p_full)` (the tombstones before it stay), everything else from
    the compute start on is (re)computed and inserted live."""
    if not reuse.repaired or window is None:
        return reuse.compute_start
    return p_full - ceil_page(window, page_size)

"""Integrity checks of a `HybridAllocator` (docs/design.md §12).

Vectorised over the mapping so it stays cheap enough to run after every test step and whenever
the scheduler is idle. Each failure raises AssertionError naming the broken invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.kv.hybrid_allocator import HybridAllocator


def _page_is_free(flags: bytes) -> torch.Tensor:
    """Bool tensor, index = page id."""
    return torch.frombuffer(bytearray(flags), dtype=torch.uint8).bool()


def _fail(msg: str) -> None:
    raise AssertionError(f"HybridAllocator integrity: {msg}")


def check_allocator(a: HybridAllocator) -> None:
    """Per-pool free-list checks, the sentinel, then the mapping invariants."""
    a.full.check_integrity()
    if a.hybrid:
        a.swa.check_integrity()
    if a.mapping.numel() != a.full_size + a.page_size + 1:
        _fail(f"mapping has {a.mapping.numel()} entries, expected full_size + page_size + 1")
    if int(a.mapping[-1]) != -1:
        _fail(f"sentinel mapping[-1] is {int(a.mapping[-1])}, must stay -1")
    body = a.mapping[:-1]
    if not a.hybrid:
        if not torch.equal(body, torch.arange(body.numel(), dtype=body.dtype)):
            _fail("a non-hybrid mapping must be the identity")
        return
    _check_entries(a, body)
    _check_pairing(a, body)


def _check_entries(a: HybridAllocator, body: torch.Tensor) -> None:
    P = a.page_size
    if bool((body < 0).any()):
        _fail(f"negative mapping entry at full slot {int((body < 0).nonzero()[0])}")
    if bool((body[:P] != 0).any()):
        _fail("a slot of reserved full page 0 is mapped")
    slot_page = torch.arange(body.numel()) // P
    mapped = body > 0
    stale = mapped & _page_is_free(a.full.free_flags())[slot_page]
    if bool(stale.any()):
        _fail(f"full slot {int(stale.nonzero()[0])} lies on a free page but is still mapped")
    swa = body[mapped]
    if swa.numel() == 0:
        return
    if int(swa.max()) >= a.swa_size + P:
        _fail(f"mapping points past the SWA pool (slot {int(swa.max())})")
    values, counts = torch.unique(swa, return_counts=True)
    if bool((counts > 1).any()):
        _fail(f"SWA slot {int(values[counts > 1][0])} is mapped from two full slots")
    on_free = _page_is_free(a.swa.free_flags())[swa // P]
    if bool(on_free.any()):
        _fail(f"a mapping entry points at SWA slot {int(swa[on_free][0])} on a free page")
    full_slots = mapped.nonzero().reshape(-1)
    if bool((swa % P != full_slots % P).any()):
        _fail("a full slot and its SWA slot sit at different in-page offsets")


def _check_pairing(a: HybridAllocator, body: torch.Tensor) -> None:
    """Full and SWA pages pair one to one, and no allocated SWA page is unreachable."""
    P = a.page_size
    mapped = body > 0
    pairs = torch.stack([mapped.nonzero().reshape(-1) // P, body[mapped] // P])
    pairs = torch.unique(pairs, dim=1) if pairs.numel() else pairs
    for side, name in ((0, "full"), (1, "SWA")):
        pages, counts = torch.unique(pairs[side], return_counts=True)
        if bool((counts > 1).any()):
            _fail(f"{name} page {int(pages[counts > 1][0])} pairs with two pages of the other pool")
    used = ~_page_is_free(a.swa.free_flags())
    used[0] = False
    used[pairs[1]] = False
    if bool(used.any()):
        _fail(f"SWA page {int(used.nonzero()[0])} is allocated but no full slot maps to it (leak)")

"""`HybridAllocator`: the full/SWA page-allocator pair and the full -> SWA slot mapping.

Every token owns a slot in the full pool (the backbone: request tables and tree values hold full
slots). While its SWA KV is alive it also owns an SWA slot, found through ``mapping``:

    full slot f ──mapping[f]──▶ SWA slot s   (0 = "no SWA slot"; page 0 is reserved in both pools)

    mapping  [ 0 0 0 0 | 9 10 11 0 | 0 0 0 0 | 5 6 7 8 | ... | -1 ]      (page_size 4)
               page 0    full pg 1   full pg 2  full pg 3          sentinel: mapping[-1] == -1
               reserved  -> SWA pg 2 SWA freed  -> SWA pg 1        so translate(-1) == -1

Both pools hand out pages in pairs and a token's offset inside its page is the same in both,
so a full page maps onto exactly one SWA page. Allocation is atomic: both pools are checked
before either is touched, and a refused (None) or rejected (error) call changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.kv.allocator import PageAllocator, check_page_size, check_pool_size
from worker.kv.integrity import check_allocator

_I64 = torch.int64
SMALL_DECODE_BATCH = 1  # alloc_decode: one request takes alloc_extend (19 us against the pass's 26; 2+: the pass)


@dataclass(frozen=True)
class AllocatorSnapshot:
    """Free lists (in order) and mapping; equal snapshots mean nothing changed. O(size)."""

    full_free: tuple[int, ...]
    swa_free: tuple[int, ...]
    mapping: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _ExtendPlan:
    """One request of an alloc_extend: `cont` tokens continue the partial page, `rest` go on
    `pages` fresh pages."""

    cont: int
    full_next: int  # first continuation slot in the full pool
    swa_next: int  # the same in the SWA pool
    rest: int
    pages: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def page_slots(pages: torch.Tensor | Sequence[int], page_size: int) -> torch.Tensor:
    """Every slot of the given pages, page by page (1-D int64)."""
    pages = torch.as_tensor(pages, dtype=_I64)
    return (pages[:, None] * page_size + torch.arange(page_size, dtype=_I64)).reshape(-1)


class HybridAllocator:
    """Paired paged allocators for the full and SWA pools (one pool when ``hybrid=False``)."""

    def __init__(self, full_size: int, swa_size: int, page_size: int, hybrid: bool = True) -> None:
        check_page_size(page_size)
        check_pool_size("full_size", full_size, page_size)
        if hybrid:
            check_pool_size("swa_size", swa_size, page_size)
        else:
            swa_size = full_size  # one pool serves both kinds
        self.page_size = page_size
        self.full_size = full_size
        self.swa_size = swa_size
        self.hybrid = hybrid
        self.full = PageAllocator(full_size // page_size, page_size, "full")
        self.swa = PageAllocator(swa_size // page_size, page_size, "swa") if hybrid else self.full
        # CPU int64, len full_size + page_size + 1; the last entry is the permanent -1 sentinel.
        self.mapping = torch.zeros(full_size + page_size + 1, dtype=_I64)
        self._reset_mapping()

    def _reset_mapping(self) -> None:
        if self.hybrid:
            self.mapping.zero_()
        else:  # NOTE: identity, so code that gathers through `mapping` directly stays correct.
            self.mapping[:-1] = torch.arange(self.full_size + self.page_size, dtype=_I64)
        self.mapping[-1] = -1

    def clear(self) -> None:
        """Free everything in both pools and unmap every slot (the sentinel stays -1)."""
        self.full.clear()
        if self.hybrid:
            self.swa.clear()
        self._reset_mapping()

    # ---- sizes ------------------------------------------------------------------------------
    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    # ---- allocation -------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` tokens on fresh pages (token i at in-page offset i % page_size in both pools).

        Returns the full slots, or None (nothing changed) if either pool lacks the pages.
        """
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        num_pages = _ceil_div(n, self.page_size)
        if not self._fits(num_pages):
            return None
        full_pages, swa_pages = self._take_pages(num_pages)
        full = page_slots(full_pages, self.page_size)[:n]
        swa = page_slots(swa_pages, self.page_size)[:n]
        self._map_fresh(full_pages, full, swa)
        return full

    def alloc_full(self, n: int) -> torch.Tensor | None:
        """`n` tokens (whole pages) on fresh full pages without SWA slots (mapping 0): full KV
        coming back from the host tier, its SWA KV elsewhere. None (no change) when short."""
        P = self.page_size
        assert n % P == 0, f"alloc_full takes whole pages, got {n} tokens"
        pages = self.full.alloc(n // P)
        if pages is None:
            return None
        full = page_slots(pages, P)
        if self.hybrid:
            self.mapping[full] = 0
        return full

    def attach_swa(self, full: torch.Tensor) -> torch.Tensor | None:
        """Fresh SWA pages for the (whole, unmapped) full pages of `full`, mapped slot by slot:
        SWA KV coming back from the host tier. Returns the SWA slots; None (no change) when
        the SWA pool is short."""
        P = self.page_size
        full = torch.as_tensor(full, dtype=_I64).reshape(-1)
        assert self.hybrid and full.numel() % P == 0, "attach_swa: whole pages of a hybrid pool"
        if bool((self.mapping[full] != 0).any()):
            raise ValueError("attach_swa: a full slot already has an SWA slot")
        pages = self.swa.alloc(full.numel() // P)
        if pages is None:
            return None
        swa = page_slots(pages, P)
        self.mapping[full] = swa
        return swa

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> torch.Tensor | None:
        """Slots for positions ``[prefix_len, seq_len)`` of each request, concatenated.

        Per request the first ``min(seq, ceil_P(prefix)) - prefix`` tokens continue the partial
        last page at ``last_loc + 1, ...`` (its SWA twin at ``mapping[last_loc] + 1, ...``), the
        rest go on fresh pages. ``last_loc`` is -1 (or anything) when ``prefix`` is page aligned.
        The gate counts ``sum(ceil(seq/P) - ceil(prefix/P))`` new pages against BOTH pools;
        None (nothing changed) when they do not fit. Invalid input raises and changes nothing.
        """
        plans = self._plan_extend(prefix_lens, seq_lens, last_locs)
        num_pages = sum(p.pages for p in plans)
        if not self._fits(num_pages):
            return None
        full_pages, swa_pages = self._take_pages(num_pages)
        full, swa = self._extend_slots(plans, full_pages, swa_pages)
        self._map_fresh(full_pages, full, swa)
        return full

    def alloc_decode(
        self, seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> torch.Tensor | None:
        """One slot per request for position ``seq_len - 1`` (seq_lens include the new token).

        A fresh page is taken iff ``(seq_len - 1) % page_size == 0``, else the slot after
        ``last_loc`` (its SWA twin after ``mapping[last_loc]``); atomic like alloc_extend and
        with its checks, vectorised over the batch (a fixed number of tensor ops, no loop);
        a batch of at most SMALL_DECODE_BATCH requests goes through alloc_extend (cheaper there).
        """
        if len(seq_lens) <= SMALL_DECODE_BATCH:  # fewer tensor ops per request than the pass
            for s in seq_lens:
                if int(s) < 1:
                    raise ValueError(f"alloc_decode: seq_lens include the new token, got {int(s)}")
            return self.alloc_extend([int(s) - 1 for s in seq_lens], seq_lens, last_locs)
        # NOTE: numpy over views of the mapping and the free flags (shared memory, no copy):
        # the same dozen vector ops cost ~1 us each against ~5 us as torch ops on a few rows.
        seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        last = np.asarray(last_locs, dtype=np.int64).reshape(-1)
        if seq.shape != last.shape:
            raise ValueError(
                f"alloc_decode: seq_lens ({seq.size}) and last_locs ({last.size}) must have "
                "one entry per request"
            )
        if seq.size == 0:
            return torch.empty(0, dtype=_I64)
        if int(seq.min()) < 1:
            raise ValueError(f"alloc_decode: seq_lens include the new token, got {int(seq.min())}")
        P = self.page_size
        pos = seq - 1
        fresh = pos % P == 0
        cont = ~fresh
        num_pages = int(fresh.sum())
        full = np.empty_like(seq)
        swa = np.empty_like(seq)
        if cont.any():
            full[cont], swa[cont] = self._continue_decodes(pos[cont], last[cont])
        if not self._fits(num_pages):
            return None
        full_pages, swa_pages = self._take_pages(num_pages)
        if num_pages:
            full[fresh] = np.asarray(full_pages, dtype=np.int64) * P
            swa[fresh] = np.asarray(swa_pages, dtype=np.int64) * P
        out = torch.from_numpy(full)
        self._map_fresh(full_pages, out, torch.from_numpy(swa))
        return out

    def _continue_decodes(self, pos: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`_continuation`'s checks for many one-token continuations at once."""
        P = self.page_size
        in_pool = (last >= P) & (last < self.full_size + P)
        pages = np.where(in_pool, last // P, 0)
        free = self.full.free_flag_view()
        bad = ~in_pool | (free[pages] != 0) | (last % P != (pos - 1) % P)
        if bad.any():
            i = int(bad.nonzero()[0][0])
            self._continuation(int(pos[i]), int(last[i]), 1)  # raises with the precise message
            raise AssertionError("unreachable: _continuation accepted a rejected continuation")
        if not self.hybrid:
            return last + 1, last + 1
        mapping = self.mapping.numpy()
        swa_last = mapping[last]
        wrong = (swa_last <= 0) | (mapping[last + 1] != 0)
        if wrong.any():
            i = int(wrong.nonzero()[0][0])
            self._continuation(int(pos[i]), int(last[i]), 1)
            raise AssertionError("unreachable: _continuation accepted a rejected continuation")
        return last + 1, swa_last + 1

    def _fits(self, num_pages: int) -> bool:
        return num_pages <= self.full.num_free_pages and num_pages <= self.swa.num_free_pages

    def _take_pages(self, num_pages: int) -> tuple[list[int], list[int]]:
        full_pages = self.full.alloc(num_pages)
        swa_pages = self.swa.alloc(num_pages) if self.hybrid else full_pages
        assert full_pages is not None and swa_pages is not None, "checked by _fits"
        return full_pages, swa_pages

    def _map_fresh(self, full_pages: list[int], full: torch.Tensor, swa: torch.Tensor) -> None:
        if not self.hybrid:
            return
        # NOTE: zero the whole fresh full pages first. Their unused tail slots must read "no SWA
        # slot" even if some path left a stale entry behind (a stale entry later frees an SWA page
        # that belongs to someone else).
        if full_pages:
            self.mapping[page_slots(full_pages, self.page_size)] = 0
        self.mapping[full] = swa

    def _plan_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> list[_ExtendPlan]:
        if not len(prefix_lens) == len(seq_lens) == len(last_locs):
            raise ValueError(
                f"alloc_extend: prefix_lens ({len(prefix_lens)}), seq_lens ({len(seq_lens)}) and "
                f"last_locs ({len(last_locs)}) must have one entry per request"
            )
        P = self.page_size
        plans = []
        for prefix, seq, last in zip(prefix_lens, seq_lens, last_locs):
            prefix, seq, last = int(prefix), int(seq), int(last)
            if not 0 <= prefix <= seq:
                raise ValueError(
                    f"alloc_extend: need 0 <= prefix_len <= seq_len, got {prefix}, {seq}"
                )
            cont = min(seq, _ceil_div(prefix, P) * P) - prefix
            full_next = swa_next = 0
            if cont > 0:
                full_next, swa_next = self._continuation(prefix, last, cont)
            rest = seq - prefix - cont
            plans.append(_ExtendPlan(cont, full_next, swa_next, rest, _ceil_div(rest, P)))
        return plans

    def _continuation(self, prefix: int, last_loc: int, cont: int) -> tuple[int, int]:
        """Validate continuing the partial page after `last_loc`; return the next slots."""
        P = self.page_size
        if (
            last_loc < P
            or last_loc >= self.full_size + P
            or not self.full.is_allocated(last_loc // P)
        ):
            raise ValueError(
                f"alloc_extend: prefix_len {prefix} ends inside a page, so last_loc must be the "
                f"allocated full slot of position {prefix - 1}; got {last_loc}"
            )
        if last_loc % P != (prefix - 1) % P:
            raise ValueError(
                f"alloc_extend: last_loc {last_loc} sits at in-page offset {last_loc % P}, but "
                f"position {prefix - 1} must sit at offset {(prefix - 1) % P}"
            )
        if not self.hybrid:
            return last_loc + 1, last_loc + 1
        swa_last = int(self.mapping[last_loc])
        if swa_last <= 0:
            raise RuntimeError(
                f"alloc_extend: the partial page holding position {prefix - 1} (full slot "
                f"{last_loc}) has no SWA page any more; the out-of-window frontier must stay at or "
                "below floor_P(prefix_len)"
            )
        nxt = self.mapping[last_loc + 1 : last_loc + 1 + cont]
        if bool((nxt != 0).any()):
            raise RuntimeError(
                f"alloc_extend: slots after last_loc {last_loc} are already mapped; was the page "
                "continued twice?"
            )
        return last_loc + 1, swa_last + 1

    def _extend_slots(
        self, plans: list[_ExtendPlan], full_pages: list[int], swa_pages: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        full_parts, swa_parts, used = [], [], 0
        for p in plans:
            if p.cont:
                full_parts.append(torch.arange(p.full_next, p.full_next + p.cont, dtype=_I64))
                swa_parts.append(torch.arange(p.swa_next, p.swa_next + p.cont, dtype=_I64))
            if p.rest:
                page_range = slice(used, used + p.pages)
                full_parts.append(page_slots(full_pages[page_range], self.page_size)[: p.rest])
                swa_parts.append(page_slots(swa_pages[page_range], self.page_size)[: p.rest])
                used += p.pages
        if not full_parts:
            return torch.empty(0, dtype=_I64), torch.empty(0, dtype=_I64)
        return torch.cat(full_parts), torch.cat(swa_parts)

    # ---- freeing ----------------------------------------------------------------------------
    def free(self, full_indices: torch.Tensor) -> None:
        """Free the full pages holding these slots, then their SWA pages (via free_swa).

        Entries <= 0 mean "no slot" (dummy slot 0, the -1 pad) and are skipped. NOT idempotent:
        freeing a page that is already free raises ValueError (a double free) and changes nothing.
        """
        idx = self._live_index(full_indices, "free")
        if idx.numel() == 0:
            return
        pages = torch.unique(idx // self.page_size).tolist()
        self.full.check_freeable(pages)  # raise before anything changes
        self.free_swa(idx)
        self.full.free(pages)

    def free_swa(self, full_indices: torch.Tensor) -> None:
        """Free the SWA pages behind the full pages holding these slots; unmap those full pages.

        Idempotent: a second call finds the mapping zeroed and frees nothing. Expands to whole
        pages, so freeing one token releases and unmaps its whole page. No-op when not hybrid.
        """
        if not self.hybrid:
            return
        idx = self._live_index(full_indices, "free_swa")
        if idx.numel() == 0:
            return
        slots = page_slots(torch.unique(idx // self.page_size), self.page_size)
        swa = self.mapping[slots]
        swa_pages = torch.unique(swa[swa > 0] // self.page_size).tolist()
        self.swa.check_freeable(swa_pages)  # a mapped SWA page that is free = corrupted mapping
        self.mapping[slots] = 0
        self.swa.free(swa_pages)

    def _live_index(self, full_indices: torch.Tensor, op: str) -> torch.Tensor:
        idx = torch.as_tensor(full_indices, dtype=_I64).reshape(-1).cpu()
        idx = idx[idx > 0]
        limit = self.full_size + self.page_size
        if idx.numel() and int(idx.max()) >= limit:
            raise ValueError(f"{op}: full slot {int(idx.max())} is outside the pool (< {limit})")
        return idx

    # ---- translation ------------------------------------------------------------------------
    def translate(self, full_indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of these full slots: ``mapping[full]`` (0 = none, -1 -> -1; identity if not
        hybrid). Returns a tensor on the input's device."""
        idx = torch.as_tensor(full_indices, dtype=_I64)
        if idx.device != self.mapping.device:
            return self.mapping[idx.cpu()].to(idx.device)
        return self.mapping[idx]

    def set_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        """Point full slots at SWA slots (0 unmaps). Used to adopt or drop SWA on revival."""
        full = torch.as_tensor(full_indices, dtype=_I64).reshape(-1).cpu()
        swa = torch.as_tensor(swa_indices, dtype=_I64).reshape(-1).cpu()
        if full.shape != swa.shape:
            raise ValueError(f"set_mapping: {full.numel()} full slots but {swa.numel()} SWA slots")
        if not self.hybrid:
            if not torch.equal(full, swa):
                raise ValueError("set_mapping: a non-hybrid allocator maps every slot to itself")
            return
        self._check_set_mapping(full, swa)
        self.mapping[full] = swa

    def _check_set_mapping(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        P = self.page_size
        if full.numel() and (int(full.min()) < P or int(full.max()) >= self.full_size + P):
            raise ValueError("set_mapping: full slots must be real slots (not page 0, in range)")
        if torch.unique(full).numel() != full.numel():
            raise ValueError("set_mapping: a full slot is listed twice")
        if any(not self.full.is_allocated(p) for p in torch.unique(full // P).tolist()):
            raise ValueError("set_mapping: a full slot lies on a free page")
        live = swa != 0
        s = swa[live]
        if s.numel() and (int(s.min()) < P or int(s.max()) >= self.swa_size + P):
            raise ValueError("set_mapping: SWA slots must be 0 (unmap) or real slots in range")
        if any(not self.swa.is_allocated(p) for p in torch.unique(s // P).tolist()):
            raise ValueError("set_mapping: an SWA slot lies on a free SWA page")
        if bool((s % P != full[live] % P).any()):
            raise ValueError("set_mapping: full and SWA slots must share their in-page offset")

    # ---- tests and invariants ---------------------------------------------------------------
    def snapshot(self) -> AllocatorSnapshot:
        return AllocatorSnapshot(
            tuple(self.full.free_pages()),
            tuple(self.swa.free_pages()),
            tuple(self.mapping.tolist()),
        )

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (docs/design.md §12)."""
        check_allocator(self)

    def __repr__(self) -> str:
        return (
            f"HybridAllocator(page_size={self.page_size}, hybrid={self.hybrid}, "
            f"full={self.full_available_size()}/{self.full_size} free, "
            f"swa={self.swa_available_size()}/{self.swa_size} free)"
        )

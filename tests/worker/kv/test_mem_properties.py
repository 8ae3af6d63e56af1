"""Property test: random alloc / extend / decode / free / free_swa / frontier sequences.

A plain-Python model tracks each request's table and which of its pages lost their SWA; after
every step the allocator must agree with it (counts, mapping, offsets) and pass check_integrity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core.geometry import Geometry
from worker.kv import HybridAllocator, free_out_of_window


@dataclass
class Req:
    table: list[int]
    evicted: int = 0
    dead: set[int] = field(default_factory=set)  # page indices (position // P) without SWA


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 4, 16]),
        window=st.sampled_from([1, 3, 4, 64, 127]),
        full_pages=st.integers(3, 24),
        swa_pages=st.integers(2, 24),
    )
    def setup(self, page: int, window: int, full_pages: int, swa_pages: int) -> None:
        self.P, self.W = page, window
        self.a = HybridAllocator(full_pages * page, swa_pages * page, page)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0

    # ---- helpers ----------------------------------------------------------------------------
    def owned(self) -> set[int]:
        return {s for r in self.reqs.values() for s in r.table}

    def pages_needed(self, prefix: list[int], seq: list[int]) -> int:
        return sum(ceil_div(s, self.P) - ceil_div(p, self.P) for p, s in zip(prefix, seq))

    def fits(self, pages: int) -> bool:
        return pages <= self.a.full.num_free_pages and pages <= self.a.swa.num_free_pages

    def continues_dead_page(self, r: Req, k: int) -> bool:
        n = len(r.table)
        return k > 0 and n % self.P != 0 and (n - 1) // self.P in r.dead

    def check_fresh(self, out: torch.Tensor, positions: list[int]) -> None:
        slots = out.tolist()
        assert len(set(slots)) == len(slots), "a slot handed out twice in one call"
        assert not set(slots) & self.owned(), "a slot handed out while still owned"
        assert min(slots, default=self.P) >= self.P, "a slot of page 0 handed out"
        assert [s % self.P for s in slots] == [p % self.P for p in positions]
        assert torch.equal(self.a.translate(out) % self.P, out % self.P)

    def attempt(self, call, prefix: list[int], seq: list[int], dead: bool):
        before = self.a.snapshot()
        expect_ok = self.fits(self.pages_needed(prefix, seq))
        if dead:
            event("continuation into an SWA-freed page refused")
            with pytest.raises(RuntimeError, match="no SWA page"):
                call()
            assert self.a.snapshot() == before
            return None
        out = call()
        if out is None:
            event("allocation refused")
            assert self.a.snapshot() == before, "a refused allocation changed the pools"
        assert (out is not None) == expect_ok, "refused although it fits, or the reverse"
        return out

    # ---- allocation rules -------------------------------------------------------------------
    @rule(n=st.integers(1, 40))
    def alloc(self, n: int) -> None:
        out = self.attempt(lambda: self.a.alloc(n), [0], [n], dead=False)
        if out is not None:
            self.check_fresh(out, list(range(n)))
            self.reqs[self.next_id] = Req(out.tolist())
            self.next_id += 1

    @rule(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3))
    def alloc_extend_new(self, lens: list[int]) -> None:
        prefix = [0] * len(lens)
        out = self.attempt(
            lambda: self.a.alloc_extend(prefix, lens, [-1] * len(lens)), prefix, lens, dead=False
        )
        if out is not None:
            self.check_fresh(out, [p for n in lens for p in range(n)])
            offset = 0
            for n in lens:
                self.reqs[self.next_id] = Req(out[offset : offset + n].tolist())
                self.next_id += 1
                offset += n

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), decode=st.booleans())
    def grow(self, data: st.DataObject, decode: bool) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, unique=True))
        ks = [1] * len(ids) if decode else [data.draw(st.integers(0, 20)) for _ in ids]
        reqs = [self.reqs[i] for i in ids]
        prefix = [len(r.table) for r in reqs]
        seq = [p + k for p, k in zip(prefix, ks)]
        last = [r.table[-1] for r in reqs]
        dead = any(self.continues_dead_page(r, k) for r, k in zip(reqs, ks))
        if decode:
            out = self.attempt(lambda: self.a.alloc_decode(seq, last), prefix, seq, dead)
        else:
            out = self.attempt(lambda: self.a.alloc_extend(prefix, seq, last), prefix, seq, dead)
        if out is None:
            return
        self.check_fresh(out, [pos for p, s in zip(prefix, seq) for pos in range(p, s)])
        offset = 0
        for r, k in zip(reqs, ks):
            r.table += out[offset : offset + k].tolist()
            offset += k

    # ---- freeing rules ----------------------------------------------------------------------
    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), again=st.booleans())
    def free(self, data: st.DataObject, again: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        table = torch.tensor(self.reqs.pop(rid).table)
        self.a.free(table)
        if again:  # immediately, before the pages can be reused: a detected double free
            before = self.a.snapshot()
            with pytest.raises(ValueError, match="double free"):
                self.a.free(table)
            assert self.a.snapshot() == before

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_swa(self, data: st.DataObject) -> None:
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        lo = data.draw(st.integers(0, len(r.table) - 1))
        hi = data.draw(st.integers(lo + 1, len(r.table)))
        newly = {p // self.P for p in range(lo, hi)} - r.dead
        swa_free = self.a.swa_available_size()
        self.a.free_swa(torch.tensor(r.table[lo:hi]))
        assert self.a.swa_available_size() - swa_free == len(newly) * self.P
        r.dead |= newly
        snap = self.a.snapshot()
        self.a.free_swa(torch.tensor(r.table[lo:hi]))
        assert self.a.snapshot() == snap, "free_swa twice freed twice"

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk_cache=st.booleans())
    def frontier(self, data: st.DataObject, chunk_cache: bool) -> None:
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        pre_len = len(r.table)  # the next query's position
        new = free_out_of_window(
            self.a,
            torch.tensor(r.table),
            Geometry(self.P, self.W),
            evicted=r.evicted,
            protected=0,
            pre_len=pre_len,
            chunk_cache=chunk_cache,
        )
        assert new >= r.evicted and new % self.P == 0
        assert new <= max(r.evicted, pre_len - self.W), "freed KV the next query needs"
        assert new <= (pre_len // self.P) * self.P, "freed the partial page"
        if new > r.evicted:
            event("frontier advanced")
        r.dead |= set(range(r.evicted // self.P, new // self.P))
        r.evicted = new

    @rule()
    def free_non_slots(self) -> None:
        snap = self.a.snapshot()
        self.a.free(torch.tensor([-1, 0]))
        self.a.free_swa(torch.tensor([-1, 0]))
        assert self.a.snapshot() == snap

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        a, P = self.a, self.P
        a.check_integrity()
        assert int(a.mapping[-1]) == -1
        full_pages = sum(ceil_div(len(r.table), P) for r in self.reqs.values())
        swa_pages = full_pages - sum(len(r.dead) for r in self.reqs.values())
        assert a.full.num_used_pages == full_pages
        assert a.swa.num_used_pages == swa_pages
        assert a.full_available_size() + full_pages * P == a.full_size
        assert a.swa_available_size() + swa_pages * P == a.swa_size
        for r in self.reqs.values():
            swa = a.translate(torch.tensor(r.table)).tolist()
            for pos, s in enumerate(swa):
                assert (s == 0) == (pos // P in r.dead)
                assert s == 0 or s % P == pos % P
        slots = [s for r in self.reqs.values() for s in r.table]
        assert len(slots) == len(set(slots)) and min(slots, default=P) >= P


AllocatorMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorProperties = AllocatorMachine.TestCase

"""Stateful property test: random request interleavings against a brute-force page model.

The model records, per cached page (by chained hash), whether it holds full + SWA KV (LIVE) or
full KV only (TOMBSTONE). Inserts and repair revivals are predicted by the model from the rules
alone; evictions and early releases are the cache's choice, so the model takes them from the
events and checks they are allowed (never a locked page; under `tail_first` interior SWA before
any tail, and tails tombstoned, never deleted, by the SWA phase). After every step: each match
equals the model's valid match (and its full match), event replay == model == snapshot, and
`check_integrity` (incl. the pool identity, repairs' scratch slots counted) holds.

Requests come with one of three root hashes (no cache salt, two salts, docs/design.md §9.10),
and the model names pages by the chain of each: a match that reached across salts would exceed
the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from cache_helpers import _alloc, decode, make_cache, move_frontier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from core.events import ROOT_HASH, EventKind, PageState, page_hashes, replay, salted_root
from worker.cache.base import LockReceipt
from worker.cache.match import match_path
from worker.cache.req_kv import ReqKV
from worker.scheduler.kv_state import record

LIVE, TOMB = PageState.LIVE, PageState.TOMBSTONE
tokens_st = st.lists(st.integers(0, 2), min_size=2, max_size=14)
ROOTS = (ROOT_HASH, salted_root("tenant-a"), salted_root("tenant-b"))
roots_st = st.sampled_from(ROOTS)


@dataclass(eq=False)
class Reader:
    tokens: list[int]
    receipt: LockReceipt
    root: int


class PageModel:
    """Per-page presence; the window rule computed by brute force."""

    def __init__(self, page_size: int, window: int | None) -> None:
        self.P, self.W = page_size, window
        self.pages: dict[int, PageState] = {}

    def valid_match(self, tokens: list[int], root: int = ROOT_HASH) -> int:
        run, tombstone_seen, best = 0, False, 0
        for i, h in enumerate(page_hashes(tokens, self.P, root)):
            state = self.pages.get(h)
            if state is None:
                break
            run = run + self.P if state is LIVE else 0
            tombstone_seen |= state is TOMB
            if self.W is None or not tombstone_seen or run >= self.W:
                best = (i + 1) * self.P
        return best

    def full_match(self, tokens: list[int], root: int) -> int:
        n = 0
        for h in page_hashes(tokens, self.P, root):
            if h not in self.pages:
                break
            n += self.P
        return n

    def revive(self, tokens: list[int], start: int, tail: int, root: int) -> None:
        """A finished repair over tokens[start:]: the last `tail` tokens' pages are LIVE."""
        end = len(tokens)
        lo = max(start, end - tail)
        for i, h in enumerate(page_hashes(tokens, self.P, root)):
            if i * self.P >= lo:
                assert h in self.pages, "a repaired page vanished while FULL-locked"
                self.pages[h] = LIVE

    def insert(self, tokens: list[int], prev: int, evicted: int, root: int) -> None:
        for i, h in enumerate(page_hashes(tokens, self.P, root)):
            pos = i * self.P
            has_swa = pos >= evicted
            if h not in self.pages:
                assert pos >= prev, "the request's protected prefix vanished"
                self.pages[h] = LIVE if has_swa else TOMB
            elif self.pages[h] is TOMB and has_swa and pos >= prev:
                self.pages[h] = LIVE


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    window: int | None = 4
    eager = False
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        P = self.page_size
        self.cache = make_cache(
            P, self.window, 96 * P, 48 * P, eager_swa_free=self.eager, swa_eviction_policy=self.policy
        )
        self.model = PageModel(P, self.window)
        self.replayed: dict[int, PageState] = {}
        self.reqs: list[ReqKV] = []
        self.released: set[int] = set()  # id() of requests past early release (decode only)
        self.readers: list[Reader] = []
        self.history: list[tuple[int, list[int]]] = []  # every (root, sequence) a request started with

    # ---- event bookkeeping ----------------------------------------------------------------
    def absorb(self, *, inserted: bool = False) -> None:
        """Apply drained events: inserts were predicted (compare), evictions are taken."""
        events = self.cache.drain_events()
        replay(events, self.replayed)
        locked = self._locked_pages()
        for e in events:
            if e.kind is EventKind.REMOVED:
                assert not locked & set(e.page_hashes), "evicted a locked page"
                for h in e.page_hashes:
                    del self.model.pages[h]
            elif e.kind is EventKind.SWA_REMOVED:
                for h in e.page_hashes:
                    assert self.model.pages[h] is LIVE
                    self.model.pages[h] = TOMB
            else:
                assert inserted, f"{e.kind} outside an insert"
        assert self.replayed == self.model.pages

    def _locked_pages(self) -> set[int]:
        out: set[int] = set()
        for r in self.reqs:
            out.update(page_hashes(r.tokens[: r.cache_protected_len], self.page_size, r.root_hash))
        for rd in self.readers:
            out.update(page_hashes(rd.tokens, self.page_size, rd.root))
        return out

    # ---- rules ----
    @initialize(seqs=st.lists(st.tuples(roots_st, tokens_st), min_size=2, max_size=5), decoded=st.integers(0, 12))
    def seed(self, seqs: list[tuple[int, list[int]]], decoded: int) -> None:
        """Start from a populated tree: finished requests that decoded and moved their
        frontier (tombstone prefixes), so the rules below meet shared paths at once."""
        for root, tokens in seqs:
            m = self.cache.match_prefix(tokens[:-1], root)
            req = _allocate(self.cache, tokens, m.indices, m.length, self.cache.lock(m.node), root)
            self.absorb()
            if req is None:
                continue
            self.history.append((root, tokens))
            decode(self.cache, req, [t % 3 for t in range(decoded)])
            if self.window is not None:
                move_frontier(self.cache, req)
            self.absorb()  # decode may have evicted (its events come before the insert's)
            aligned = req.kv_committed_len - req.kv_committed_len % self.page_size
            record(req, self.cache.cache_finished_req(req))
            self.model.insert(req.tokens[:aligned], req.cache_protected_len, req.swa_evicted_seqlen, root)
            self.absorb(inserted=True)

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(data=st.data(), tail=tokens_st)
    def start(self, data: st.DataObject, tail: list[int]) -> None:
        root, tokens = self._query(data, tail)
        self.history.append((root, tokens))
        expected = self.model.valid_match(tokens[:-1], root)
        m = self.cache.match_prefix(tokens[:-1], root)
        assert m.length == expected
        receipt = self.cache.lock(m.node)
        req = _allocate(self.cache, tokens, m.indices, m.length, receipt, root)
        self.absorb()
        if req is not None:
            self.reqs.append(req)

    def _ready(self) -> list[ReqKV]:
        return [r for r in self.reqs if not r.repairing]

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        req = data.draw(st.sampled_from(self._ready()))
        decode(self.cache, req, new)
        self.absorb()

    @precondition(lambda self: self._ready() and self.window is not None)
    @rule(data=st.data())
    def frontier(self, data: st.DataObject) -> None:
        move_frontier(self.cache, data.draw(st.sampled_from(self._ready())))

    def _unreleased(self) -> list[ReqKV]:
        return [r for r in self._ready() if id(r) not in self.released]

    @precondition(lambda self: self._unreleased())
    @rule(data=st.data())
    def unfinished(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._unreleased()))
        prev = req.cache_protected_len
        record(req, self.cache.cache_unfinished_req(req))  # may move the frontier first (eager)
        aligned = req.kv_committed_len - req.kv_committed_len % self.page_size
        if aligned > prev:
            self.model.insert(req.tokens[:aligned], prev, req.swa_evicted_seqlen, req.root_hash)
        self.absorb(inserted=True)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        self.released.discard(id(req))
        aligned = req.kv_committed_len - req.kv_committed_len % self.page_size
        record(req, self.cache.cache_finished_req(req, insert=insert))
        if insert:
            self.model.insert(req.tokens[:aligned], req.cache_protected_len, req.swa_evicted_seqlen, req.root_hash)
        self.absorb(inserted=insert)

    @precondition(lambda self: self._unreleased())
    @rule(data=st.data())
    def early_release(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._unreleased()))
        req.lock = self.cache.release_window_lock(req.lock)
        req.swa_lock_released = True
        self.released.add(id(req))
        self.absorb()

    @precondition(lambda self: len(self.reqs) < 4 and self.window is not None)
    @rule(data=st.data(), tail=tokens_st)
    def start_repair(self, data: st.DataObject, tail: list[int]) -> None:
        """A request whose full match runs past its valid one recomputes the R tokens before
        p_full into scratch pairs (docs/design.md §9.8); nothing changes in the tree yet."""
        root, tokens = self._query(data, tail, shared=True)
        if self.model.full_match(tokens[:-1], root) <= self.model.valid_match(tokens[:-1], root):
            self._tombstone_on_path(data, tokens[:-1], root)  # make one more often than chance would
        p_full = self.model.full_match(tokens[:-1], root)
        p_valid = self.model.valid_match(tokens[:-1], root)
        m = self.cache.match_prefix(tokens[:-1], root)
        assert (m.length, m.full_length) == (p_valid, p_full)
        tail = self.cache.tree.tail
        assert tail is not None
        if p_full <= p_valid or p_full < tail:
            return
        # R >= one tail (the real R is, docs/design.md §9.8); it may start below p_valid here.
        P = self.page_size
        rows = data.draw(st.integers(tail // P, p_full // P)) * P
        m = self.cache.match_full(tokens[:-1], root)
        assert m.length == p_full
        receipt = self.cache.lock(m.node)
        scratch = _alloc(self.cache, [0], [rows], [-1])
        rest = None if scratch is None else _alloc(self.cache, [p_full], [len(tokens)], [-1])
        self.absorb()
        if rest is None:
            if scratch is not None:
                self.cache.allocator.free(scratch)
            self.cache.unlock(receipt)
            return
        self.history.append((root, tokens))
        self.reqs.append(ReqKV(
            tokens=list(tokens), root_hash=root, table=torch.cat([m.indices, rest]), cache_protected_len=p_full,
            lock=receipt, kv_committed_len=p_full - rows, kv_allocated_len=len(tokens),
            repair_start=p_full - rows, repair_slots=scratch,
        ))  # fmt: skip

    def _tombstone_on_path(self, data: st.DataObject, query: list[int], root: int) -> None:
        key = tuple(query[: len(query) - len(query) % self.page_size])
        path, _ = match_path(self.cache.tree, key, window_rule=False, root_hash=root)
        live = [n for n in path if n.swa is not None and n.swa_lock == 0]
        if live:
            node = data.draw(st.sampled_from(live))
            self.cache.tree.tombstone(node)
            self.cache.allocator.free_swa(node.full)
            self.absorb()

    @precondition(lambda self: any(r.repairing for r in self.reqs))
    @rule(data=st.data())
    def finish_repair(self, data: st.DataObject) -> None:
        """The repair's forward ran: the tail's tombstones come back LIVE (SWA_RESTORED)."""
        req = data.draw(st.sampled_from([r for r in self.reqs if r.repairing]))
        start, end = req.repair_start, req.cache_protected_len
        req.kv_committed_len = len(req.tokens)
        record(req, self.cache.finish_repair(req))
        tail = self.cache.tree.tail
        assert tail is not None
        self.model.revive(req.tokens[:end], start, tail, req.root_hash)
        self.absorb(inserted=True)
        assert self.model.valid_match(req.tokens[:end], req.root_hash) == end, "a repaired prefix must be valid"

    @rule(full=st.integers(0, 8), swa=st.integers(0, 8))
    def evict(self, full: int, swa: int) -> None:
        before = dict(self.model.pages)
        roles = retention_roles(self.cache) if self.policy == "tail_first" else []
        res = self.cache.evict(full * self.page_size, swa * self.page_size)
        self.absorb()
        gone = before.keys() - self.model.pages.keys()
        tombed = {h for h in self.model.pages if before[h] is LIVE and self.model.pages[h] is TOMB}
        assert res.full == len(gone) * self.page_size
        if self.window is not None:
            lost_swa = len(tombed) + sum(before[h] is LIVE for h in gone)
            assert res.swa == lost_swa * self.page_size
        if self.policy == "tail_first" and full == 0:
            # The SWA phase tombstones in place, and interior SWA goes before any tail: a
            # node's kept tail loses SWA only once every interior page has, or once something
            # in the chain below it (which made it interior) has.
            assert not gone, "tail-first SWA eviction deleted a page"
            interior = set().union(*(r.interior for r in roles))
            for r in roles:
                if r.kept & tombed:
                    assert interior <= tombed or r.below & tombed, "a tail went before interior"

    @precondition(lambda self: self.window is not None)
    @rule(data=st.data())
    def tombstone_any(self, data: st.DataObject) -> None:
        """Chaos: tombstone any SWA-unlocked node, not just the LRU's pick, so the match rule
        meets arbitrary tombstone patterns (T, short live run, T, live …)."""
        nodes = [n for n in self.cache.tree.iter_nodes() if n.swa is not None and n.swa_lock == 0]
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.cache.tree.tombstone(node)
            self.cache.allocator.free_swa(node.full)
            self.absorb()

    @rule(data=st.data(), tail=tokens_st)
    def match(self, data: st.DataObject, tail: list[int]) -> None:
        root, query = self._query(data, tail)
        assert self.cache.match_prefix(query, root).length == self.model.valid_match(query, root)

    @precondition(lambda self: len(self.readers) < 3)
    @rule(data=st.data(), tail=tokens_st)
    def reader_lock(self, data: st.DataObject, tail: list[int]) -> None:
        root, query = self._query(data, tail)
        m = self.cache.match_prefix(query, root)
        self.readers.append(Reader(query[: m.length], self.cache.lock(m.node), root))

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def reader_unlock(self, data: st.DataObject) -> None:
        rd = data.draw(st.sampled_from(self.readers))
        self.readers.remove(rd)
        self.cache.unlock(rd.receipt)

    def _query(self, data: st.DataObject, tail: list[int], shared: bool = False) -> tuple[int, list[int]]:
        """A root hash and tokens: often (`shared`: whenever possible) a prefix of an earlier
        sequence plus a tail, that is where sharing, splits, revivals and repairs happen; with
        its root mostly, else with another salt's (where nothing may be shared)."""
        sources = self.history + [(r.root_hash, r.tokens) for r in self.reqs]
        if not sources or not (shared or data.draw(st.booleans())):
            return data.draw(roots_st), tail
        root, src = data.draw(st.sampled_from(sources))
        if not shared and data.draw(st.integers(0, 3)) == 0:
            root = data.draw(roots_st)
        return root, src[: data.draw(st.integers(0, len(src)))] + tail

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(running_reqs=self.reqs)
        assert self.cache.snapshot_pages() == self.model.pages
        ret = self.cache.tree.retention
        if ret is not None:  # the heap holds exactly the nodes the literal rule calls interior
            want = {h for r in retention_roles(self.cache, locked=True) for h in r.interior}
            got = {h for n in ret.interior.members for h in n.hashes[: (len(n) - ret.keep(n)) // self.page_size]}
            assert got == want

    @invariant()
    def locked_prefixes_stay_valid(self) -> None:
        for rd in self.readers:
            assert self.model.valid_match(rd.tokens, rd.root) == len(rd.tokens)
        for r in self.reqs:
            if id(r) in self.released or r.repairing:
                hs = page_hashes(r.tokens[: r.cache_protected_len], self.page_size, r.root_hash)
                assert all(h in self.model.pages for h in hs)
            else:
                n = r.cache_protected_len
                assert self.model.valid_match(r.tokens[:n], r.root_hash) == n

    def teardown(self) -> None:
        for r in list(self.reqs):
            record(r, self.cache.cache_finished_req(r))
        for rd in self.readers:
            self.cache.unlock(rd.receipt)
        assert self.cache.full_protected == 0 and self.cache.swa_protected == 0
        self.cache.check_integrity()
        self.cache.reset()
        a = self.cache.allocator
        assert a.full_available_size() == a.full_size and a.swa_available_size() == a.swa_size


@dataclass(frozen=True)
class Roles:
    """One SWA-unlocked live node's pages by the tail-first rule (docs/design.md §9.5)."""

    interior: frozenset[int]
    kept: frozenset[int]
    below: frozenset[int]  # pages of the single-child chain under it (what its keep reads)


def retention_roles(cache, locked: bool = False) -> list[Roles]:
    """The rule read literally (unbounded recursion, no shortcut): a match ends at a leaf or
    a branch point and needs the T tokens before it; D = distance down to such an end."""
    tree, P = cache.tree, cache.page_size
    T = tree.tail
    inf = 1 << 60

    def chain(n):
        out = []
        while len(n.children) == 1:
            (n,) = n.children.values()
            out.append(n)
        return out

    def distance(n) -> int:
        if len(n.children) != 1:
            return 0
        (c,) = n.children.values()
        return inf if c.swa is None else len(c) + distance(c)

    out = []
    for n in tree.iter_nodes():
        if n.swa is None or (n.swa_lock and not locked):
            continue
        keep = max(0, min(len(n), T - distance(n)))
        cut = (len(n) - keep) // P
        below = frozenset(h for c in chain(n) for h in c.hashes)
        out.append(Roles(frozenset(n.hashes[:cut]), frozenset(n.hashes[cut:]), below))
    return out


def _allocate(cache, tokens, indices, length, receipt, root: int = ROOT_HASH) -> ReqKV | None:
    new = _alloc(cache, [length], [len(tokens)], [-1])
    if new is None:
        cache.unlock(receipt)
        return None
    return ReqKV(
        tokens=list(tokens),
        root_hash=root,
        table=torch.cat([indices, new]),
        cache_protected_len=length,
        lock=receipt,
        kv_committed_len=len(tokens),
        kv_allocated_len=len(tokens),
    )


@pytest.mark.parametrize("policy", ["lru", "tail_first"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [1, 4, 7])
def test_cache_matches_brute_force_model(page_size: int, window: int, policy: str) -> None:
    """Random interleavings (repairs included) keep matches, events and accounting exact."""
    machine = type(
        f"CacheMachineP{page_size}W{window}{policy}",
        (CacheMachine,),
        {"page_size": page_size, "window": window, "eager": window == 4, "policy": policy},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [1, 4, 7])
def test_match_rule_on_random_tombstone_patterns(page_size: int, window: int) -> None:
    """Any tombstone pattern (not only what the LRU picks): every prefix of every cached
    sequence matches exactly the brute-force valid length."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seqs=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=24), min_size=1, max_size=6),
        picks=st.lists(st.integers(0, 1000), max_size=8),
    )
    def check(seqs: list[list[int]], picks: list[int]) -> None:
        cache = make_cache(page_size, window, 256 * page_size, 256 * page_size)
        seqs = [[t for t in s for _ in range(page_size)] for s in seqs]  # whole pages
        for s in seqs:
            put_seq(cache, s)
        for p in picks:
            live = [n for n in cache.tree.iter_nodes() if n.swa is not None]
            if live:
                node = live[p % len(live)]
                if len(node) > page_size and p % 2:  # short runs: keep the first page live
                    cache.tree.split(node, page_size)
                cache.tree.tombstone(node)
                cache.allocator.free_swa(node.full)
        model = PageModel(page_size, window)
        model.pages = cache.snapshot_pages()
        for s in seqs:
            for n in range(0, len(s) + 1, page_size):
                assert cache.match_prefix(s[:n]).length == model.valid_match(s[:n])
        cache.check_integrity()

    check()


def put_seq(cache, tokens: list[int]) -> None:
    path, length = match_path(cache.tree, tuple(tokens), window_rule=False)
    fresh = cache.allocator.alloc(len(tokens) - length)
    head = [n.full for n in path]
    cache.insert(
        tokens, torch.cat([torch.empty(0, dtype=torch.int64), *head, fresh]), prev_prefix_len=length
    )

"""`RadixCache`: the façade the scheduler uses; with the host tier's component (host_tier.py)
the only cache code that touches an allocator.

It composes the tree state (tree.py) with the algorithms (match.py, insert.py, evict.py),
applies the allocator work they return, and implements the request hooks. With `window` None
(no SWA layer) or a non-hybrid allocator it is a plain radix cache: no tombstones ever. With a
host tier (`tier`, docs/design.md §9.9) eviction offloads, a match reports both tiers, and an
admission loads through `prepare_load` / `load`. Every lookup and insert names its root hash
(a request's cache salt's, docs/design.md §9.10; ROOT_HASH without one): salts share nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from core.events import ROOT_HASH, CacheEvent, EventKind, EventLog, PageState
from core.geometry import Geometry, ceil_page, floor_page
from core.reuse import TieredMatch
from worker.cache.base import (
    EvictResult,
    KVUpdate,
    LoadPlan,
    LockReceipt,
    MatchResult,
    PrefixCache,
)
from worker.cache.evict import evict as evict_tree
from worker.cache.host_tier import HostTier
from worker.cache.insert import InsertOutcome, insert
from worker.cache.integrity import check_tree
from worker.cache.match import Walk, match_path, match_walk
from worker.cache.node import Node, path_to_root
from worker.cache.repair import revive_tail
from worker.cache.req_kv import ReqKV
from worker.cache.tree import AllocOps, RadixTree
from worker.config import SWA_EVICTION_POLICIES
from worker.kv.frontier import free_out_of_window
from worker.kv.hybrid_allocator import HybridAllocator
from worker.models.spec import LayerKind

_I64 = torch.int64


class RadixCache(PrefixCache):
    """Unified radix cache with a FULL and an SWA component per node.

    Args:
        allocator: the hybrid allocator whose slots the tree holds (its page size is the
            geometry's).
        geometry: page size and window (keys to the left, docs/design.md §1; None when the model
            has no SWA layer).
        eager_swa_free: free out-of-window SWA of unfinished chunked prefills before inserting
            them (an SGLang option). Saves SWA pool, costs reuse of branches inside that span.
        swa_eviction_policy: "tail_first" (interior SWA first, tails last, tails tombstoned
            in place) or "lru" (SGLang's plain SWA LRU; docs/design.md §9.5).
        emit_events: buffer cache events for `drain_events` (off: benchmarks).
        tier: the host tier's component (None: no host tier; needs separate SWA pools).
    """

    def __init__(
        self,
        allocator: HybridAllocator,
        geometry: Geometry,
        *,
        eager_swa_free: bool = False,
        swa_eviction_policy: str = "tail_first",
        emit_events: bool = True,
        tier: HostTier | None = None,
    ) -> None:
        if geometry.page_size != allocator.page_size:
            raise ValueError(f"page_size {geometry.page_size} != the allocator's {allocator.page_size}")
        if swa_eviction_policy not in SWA_EVICTION_POLICIES:
            raise ValueError(
                f"swa_eviction_policy must be one of {SWA_EVICTION_POLICIES}, "
                f"got {swa_eviction_policy!r}"
            )
        self.allocator = allocator
        # NOTE: with one shared pool the SWA layers keep all their KV, so no window rule applies.
        self.geometry = geometry if allocator.hybrid else replace(geometry, window=None)
        self.eager_swa_free = eager_swa_free
        self.tail_first = swa_eviction_policy == "tail_first"
        if tier is not None and self.geometry.window is None:
            raise ValueError("the host tier needs separate full and SWA pools and a window")
        self.tier = tier
        self.events = EventLog(emit_events)
        self.tree = self._new_tree()

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def window(self) -> int | None:
        """Keys to the left on SWA layers; None: no window rule (no SWA layer, or one pool)."""
        return self.geometry.window

    def _new_tree(self) -> RadixTree:
        return RadixTree(self.page_size, self.window, self.events, tail_first=self.tail_first)

    # ---- sizes (tokens) -------------------------------------------------------------------
    @property
    def full_evictable(self) -> int:  # type: ignore[override]
        return self.tree.full_evictable

    @property
    def full_protected(self) -> int:  # type: ignore[override]
        return self.tree.full_protected

    @property
    def swa_evictable(self) -> int:  # type: ignore[override]
        return self.tree.swa_evictable

    @property
    def swa_protected(self) -> int:  # type: ignore[override]
        return self.tree.swa_protected

    # ---- match / insert / locks -----------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], root_hash: int = ROOT_HASH) -> MatchResult:
        walk = match_walk(self.tree, self._key(tokens), root_hash=root_hash)
        device = walk.path[: walk.device_nodes]
        self.tree.touch(walk.path[-1] if walk.path else self.tree.root, hit=True)
        tiered = None if self.tier is None else self._tiered(walk)
        end = device[-1] if device else self.tree.root
        return MatchResult(_cat([n.full for n in device]), walk.device, end, walk.full, tiered)

    def _tiered(self, walk: Walk) -> TieredMatch:
        assert self.window is not None
        lo = walk.valid - ceil_page(self.window, self.page_size)
        host_full = host_swa = pos = 0
        for n in walk.path:
            host_full += len(n) if n.full_on_host else 0
            if n.host_swa is not None:
                host_swa += max(0, pos + len(n) - max(pos, lo))
            pos += len(n)
        return TieredMatch(
            walk.full, walk.valid, walk.device, host_full, host_swa, walk.host_full_all
        )

    def match_full(self, tokens: Sequence[int], root_hash: int = ROOT_HASH) -> MatchResult:
        path, length = match_path(self.tree, self._key(tokens), window_rule=False, root_hash=root_hash)
        assert not any(n.full_on_host for n in path), "load a repair's prefix before locking it"
        end = path[-1] if path else self.tree.root
        self.tree.touch(end, hit=True)
        return MatchResult(_cat([n.full for n in path]), length, end, length)

    # ---- loads from the host tier (docs/design.md §9.9) -----------------------------------
    def prepare_load(
        self, tokens: Sequence[int], length: int, swa_from: int | None, root_hash: int = ROOT_HASH
    ) -> LoadPlan:
        """Get the cached prefix `tokens[:length]` ready to load: its nodes pinned (no eviction
        takes them), its device part locked, a node split at `swa_from` (the first position
        whose host SWA is loaded; None: full KV only). Make room for the plan's tokens, then
        `load` it (or `cancel_load`)."""
        assert self.tier is not None, "no host tier"
        key = self._key(tokens)[:length]
        path, got = match_path(self.tree, key, window_rule=False, root_hash=root_hash)
        assert got == length, f"the prefix to load is not cached ({got} < {length})"
        if swa_from is not None and swa_from > 0:
            self._split_at(path, swa_from)
            path, _ = match_path(self.tree, key, window_rule=False, root_hash=root_hash)
        device = [n for n in path if not n.full_on_host]
        receipt = self.tree.lock(device[-1]) if device else None
        for n in path:
            n.pinned = True
        full_nodes = tuple(n for n in path if n.full_on_host)
        swa_nodes, pos, loaded = [], 0, 0
        for n in path:
            takes_swa = swa_from is not None and pos >= swa_from and n.host_swa is not None
            swa_nodes += [n] if takes_swa else []
            loaded += len(n) if n.full_on_host or takes_swa else 0
            pos += len(n)
        full = sum(len(n) for n in full_nodes)
        swa = sum(len(n) for n in swa_nodes)
        return LoadPlan(tuple(path), receipt, full_nodes, tuple(swa_nodes), full, swa, loaded)

    def load(self, plan: LoadPlan) -> MatchResult:
        """Load the plan (the caller made room for its tokens in both device pools): device
        slots taken, copies queued, the nodes moved; returns the device match of the prefix.
        The loaded KV is the tree's, like any cached KV."""
        assert self.tier is not None
        for n in plan.full_nodes:
            ok = self.tier.load_full(self.tree, self.allocator, n)
            assert ok, "load: the device full pool is short (room was not made)"
        for n in plan.swa_nodes:
            ok = self.tier.load_swa(self.tree, self.allocator, n)
            assert ok, "load: the device SWA pool is short (room was not made)"
        self.tier.tokens_loaded += plan.tokens
        self.cancel_load(plan)
        end = plan.path[-1] if plan.path else self.tree.root
        length = sum(len(n) for n in plan.path)
        return MatchResult(_cat([n.full for n in plan.path]), length, end, length)

    def cancel_load(self, plan: LoadPlan) -> None:
        """Unpin the plan's nodes and drop its lock (nothing else changes)."""
        for n in plan.path:
            n.pinned = False
        if plan.receipt is not None:
            self.tree.unlock(plan.receipt)

    def _split_at(self, path: list[Node], at: int) -> None:
        pos = 0
        for n in path:
            if pos < at < pos + len(n):
                self.tree.split(n, at - pos)
                return
            pos += len(n)

    def insert(
        self,
        tokens: Sequence[int],
        full: torch.Tensor,
        *,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
        root_hash: int = ROOT_HASH,
    ) -> InsertOutcome:
        """Insert `tokens` (page-aligned) with the request's full slots `full` (int64, CPU)
        under the root of `root_hash`.

        The tree takes ownership of the request's slots from `prev_prefix_len` on, except
        duplicates of what it already holds, which are freed. Returns what was already cached
        (`prefix_len`) and the node ending the key.
        """
        key = self._key(tokens)
        assert len(key) == len(tokens), f"insert needs a page-aligned key, got {len(tokens)} tokens"
        full = torch.as_tensor(full, dtype=_I64)[: len(key)]
        out = insert(
            self.tree,
            key,
            full,
            self.allocator.translate(full),
            prev_prefix_len=prev_prefix_len,
            swa_evicted=swa_evicted_seqlen,
            root_hash=root_hash,
        )
        self._apply(out.ops)
        return out

    def lock(self, node: Node) -> LockReceipt:
        return self.tree.lock(node)

    def unlock(self, receipt: LockReceipt, skip_swa: bool = False) -> None:
        self.tree.unlock(receipt, skip_swa)

    def release_window_lock(self, receipt: LockReceipt) -> LockReceipt:
        return self.tree.release_window(receipt)

    # ---- request hooks (they read the ReqKV; the scheduler records what they return) ------
    def cache_unfinished_req(self, req: ReqKV) -> KVUpdate:
        """Chunked prefill step (docs/design.md §10.1)::

        0        protected            aligned = floor_P(kv_committed_len)
        |-- tree --|-- inserted now --|-- unaligned tail stays the request's --|
                   table[protected:aligned] := the tree's slots; protected := aligned
        """
        kv_len = req.kv_committed_len
        frontier = req.swa_evicted_seqlen
        if req.repairing:
            return _unchanged(req, frontier)  # recomputing rows the tree already holds
        if self.eager_swa_free and self.window is not None and kv_len > 0:
            frontier = free_out_of_window(
                self.allocator,
                req.table,
                self.geometry,
                evicted=frontier,
                protected=req.cache_protected_len,
                pre_len=kv_len - 1,
                chunk_cache=False,
                floor=req.swa_evict_floor,
            )
        aligned = floor_page(kv_len, self.page_size)
        if aligned <= req.cache_protected_len:
            return _unchanged(req, frontier)
        out = self.insert(
            req.tokens[:aligned],
            req.table[:aligned],
            prev_prefix_len=req.cache_protected_len,
            swa_evicted_seqlen=frontier,
            root_hash=req.root_hash,
        )
        # NOTE: the tree owns [0, aligned) now whatever the window rule says about matching
        # there, so the request's lock and table follow the inserted node, not a re-match
        # (a re-match that stops short would leave tree-owned slots marked request-owned,
        # and the next insert would free them).
        path = path_to_root(out.node)[::-1]
        slots = _cat([n.full for n in path])[req.cache_protected_len : aligned]
        return KVUpdate(self._relock(req, out.node), False, aligned, frontier, tree_slots=slots)

    def cache_finished_req(self, req: ReqKV, insert: bool = True) -> KVUpdate:
        """Finish (docs/design.md §10.2)::

        0      protected        aligned            committed      allocated
        |-tree-|-- inserted or freed --|- tail: freed -|- spare: freed -|
        """
        kv_len = req.kv_committed_len
        protected = req.cache_protected_len
        if req.repair_slots is not None:  # unfinished repair: its scratch pairs go back
            self.allocator.free(req.repair_slots)
        # (max: an unfinished repair committed less than the tree already held for it)
        aligned = max(floor_page(kv_len, self.page_size), protected)
        if insert:
            self.insert(
                req.tokens[:aligned],
                req.table[:aligned],
                prev_prefix_len=protected,
                swa_evicted_seqlen=req.swa_evicted_seqlen,
                root_hash=req.root_hash,
            )
        elif aligned > protected:
            self.allocator.free(req.table[protected:aligned])
        end = max(kv_len, req.kv_allocated_len)
        if end > aligned:
            self.allocator.free(req.table[aligned:end])
        if req.lock is not None:
            self.tree.unlock(req.lock, skip_swa=req.swa_lock_released)
        return KVUpdate(None, False, protected, req.swa_evicted_seqlen, repair_done=True)

    def finish_repair(self, req: ReqKV) -> KVUpdate:
        assert req.repair_slots is not None and req.lock is not None, "no repair in flight"
        assert req.kv_committed_len >= req.cache_protected_len, "the repair rows are not all computed"
        scratch, node = req.repair_slots, req.lock.node
        ops = revive_tail(self.tree, node, req.repair_start, scratch, self.allocator.translate(scratch))
        self._apply(ops)
        # The revived tail is what the request's next queries read: SWA-lock it.
        lock = self._relock(req, node)
        return KVUpdate(lock, False, req.cache_protected_len, req.swa_evicted_seqlen, repair_done=True)

    def _relock(self, req: ReqKV, node: Node) -> LockReceipt:
        """Lock `node` for the request, then release its old lock (new first: the shared path
        never drops to unlocked in between)."""
        lock = self.tree.lock(node)
        if req.lock is not None:
            self.tree.unlock(req.lock, skip_swa=req.swa_lock_released)
        return lock

    # ---- eviction / flush -----------------------------------------------------------------
    def evict(self, full_tokens: int, swa_tokens: int) -> EvictResult:
        if self.window is None:
            # One component: the SWA side mirrors the full side (or shares its pool).
            full, _, ops = evict_tree(self.tree, max(full_tokens, swa_tokens), 0)
            self._apply(ops)
            return EvictResult(full, full)
        full, swa, ops = evict_tree(self.tree, full_tokens, swa_tokens, self.tier)
        self._apply(ops)
        return EvictResult(full, swa)

    def reset(self) -> None:
        """Free everything unlocked, on both tiers. With no lock held the tree is emptied in
        one step and a single CLEARED event replaces per-page REMOVED events."""
        if self.tree.full_protected == 0:
            nodes = self.tree.iter_nodes()
            device = [n for n in nodes if not n.full_on_host]
            self._apply(AllocOps(free=[n.full for n in device]))
            if self.tier is not None:
                self.tier.free_all(nodes)
            self.tree = self._new_tree()
            self.events.emit(EventKind.CLEARED)
            return
        if self.tier is not None:  # the host first: device leaves then have no host children
            self.tier.evict(self.tree, self.tier.host.size(LayerKind.FULL), self.tier.host.size(LayerKind.SWA))
        full, swa, ops = evict_tree(self.tree, self.tree.full_evictable, self.tree.swa_evictable)
        self._apply(ops)

    # ---- events / checks ------------------------------------------------------------------
    def drain_events(self) -> list[CacheEvent]:
        return self.events.drain()

    def snapshot_pages(self) -> dict[int, PageState]:
        pages: dict[int, PageState] = {}
        for n in self.tree.iter_nodes():
            pages.update(dict.fromkeys(n.hashes, n.state))
        return pages

    def check_integrity(self, running_reqs: Sequence[ReqKV] = ()) -> None:
        check_tree(self.tree, self.allocator, running_reqs, self.tier)

    # ---- helpers --------------------------------------------------------------------------
    def _key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        n = floor_page(len(tokens), self.page_size)
        return tuple(tokens[:n])

    def _apply(self, ops: AllocOps) -> None:
        """The only place tree work reaches the allocator (remap, then SWA frees, then frees)."""
        for full, swa in ops.remap:
            self.allocator.set_mapping(full, swa)
        if ops.free_swa:
            self.allocator.free_swa(_cat(ops.free_swa))
        if ops.free:
            self.allocator.free(_cat(ops.free))
        if ops.host_free:
            assert self.tier is not None, "host slots without a host tier"
            self.tier.free(ops)


def _unchanged(req: ReqKV, frontier: int) -> KVUpdate:
    return KVUpdate(req.lock, req.swa_lock_released, req.cache_protected_len, frontier)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=_I64)
    return parts[0] if len(parts) == 1 else torch.cat(parts)

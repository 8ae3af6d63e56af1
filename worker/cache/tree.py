"""The radix tree's state: nodes, the four size counters, the two eviction orders, locks.

Every state change of a node goes through a method here, so the counters, the SWA LRU list,
the leaf heap and the event log can never disagree. The algorithms (match.py, insert.py,
evict.py) decide *what* changes; they never touch a counter. Nothing here touches an
allocator: operations that release KV return the slots (`AllocOps`) to the façade.

Roots: one per root hash in use (docs/design.md §9.10): `root` for requests without a cache
salt, one more per salt, created by the first insert under it and dropped with its last child,
so no walk from one root ever meets another salt's nodes. The orders and counters are shared:
salts compete for the same pools.

Counters (tokens), per pool: a node is *protected* while its lock count for that pool is > 0,
else *evictable*; a tombstone counts for neither SWA counter. KV on the host tier (docs/design.md
§9.9) counts in none of them (`host_full`, `host_swa`: tokens held there): it is never locked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.events import ROOT_HASH, EventKind, EventLog, page_hashes
from core.geometry import ceil_page, floor_page
from worker.cache.base import LockReceipt
from worker.cache.lru import LeafHeap, LRUList
from worker.cache.node import Key, Node, split_off_head
from worker.cache.retention import TailRetention
from worker.models.spec import LayerKind


@dataclass(slots=True)
class AllocOps:
    """Allocator work a tree operation leaves to the façade, applied in this field order."""

    remap: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # set_mapping
    free_swa: list[torch.Tensor] = field(default_factory=list)  # full slots: free their SWA only
    free: list[torch.Tensor] = field(default_factory=list)  # full slots (+ their mapped SWA)
    host_free: list[tuple[LayerKind, torch.Tensor]] = field(default_factory=list)  # host slots


class RadixTree:
    """Nodes + counters + LRUs + locks of one cache.

    `window` None means no SWA rule (no SWA layer, or one shared pool): nothing is ever
    tombstoned and the SWA side simply mirrors the full side. `tail_first` keeps the interior
    nodes (`retention`) for tail-first SWA eviction (docs/design.md §9.5).
    """

    def __init__(
        self, page_size: int, window: int | None, events: EventLog, *, tail_first: bool = False
    ) -> None:
        self.page_size = page_size
        self.window = window
        self.events = events
        self.root = Node.make_root()  # requests without a cache salt
        self.roots: dict[int, Node] = {ROOT_HASH: self.root}  # root hash -> root
        self.swa_lru = LRUList()
        # One window tail, page-rounded: what a match ending at a node's end needs live.
        self.tail = None if window is None else max(page_size, ceil_page(window, page_size))
        self.retention = (
            TailRetention(self.tail) if tail_first and self.tail is not None else None
        )
        self.leaves = LeafHeap()  # unlocked device leaves: full-eviction order
        self.host_leaves = LeafHeap()  # host-resident leaves: the host tier's full order
        self.host_swa_order = LeafHeap()  # nodes holding host SWA, by last access
        self.full_evictable = self.full_protected = 0
        self.swa_evictable = self.swa_protected = 0
        self.host_full = self.host_swa = 0  # tokens held on the host tier
        self._clock = 0
        self._next_boundary_id = 1

    # ---- lookup ---------------------------------------------------------------------------

    def root_for(self, root_hash: int) -> Node:
        """The root of `root_hash`'s chain, created if none is there yet."""
        root = self.roots.get(root_hash)
        if root is None:
            root = self.roots[root_hash] = Node.make_root(root_hash)
        return root

    def child(self, node: Node, key: Key, pos: int) -> Node | None:
        return node.children.get(key[pos : pos + self.page_size])

    def common_len(self, node: Node, key: Key, pos: int) -> int:
        """Page-aligned length of the common prefix of `node.key` and `key[pos:]`."""
        n = min(len(node.key), len(key) - pos)
        n = floor_page(n, self.page_size)
        if node.key[:n] == key[pos : pos + n]:  # fast path: one C-level compare
            return n
        p = self.page_size
        i = 0
        while i < n and node.key[i : i + p] == key[pos + i : pos + i + p]:
            i += p
        return i

    # ---- structure ------------------------------------------------------------------------

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` at token offset `at`; returns the new upper node (see node.py)."""
        upper = split_off_head(node, at, self.page_size)
        if node.in_lru:
            self.swa_lru.insert_older_than(node, upper)
        if upper.host_swa is not None:
            self.host_swa_order.add(upper)
        if self.retention is not None:  # lengths changed; the ancestors' walks did not
            self.retention.classify(upper)
            self.retention.classify(node)
        return upper

    def add_node(
        self, parent: Node, key: Key, full: torch.Tensor, swa: torch.Tensor | None
    ) -> Node:
        """Attach a new unlocked leaf; `swa` None creates it as a tombstone (FULL only)."""
        p = self.page_size
        assert key and len(key) % p == 0 and len(full) == len(key), (len(key), len(full), p)
        assert not parent.full_on_host, "a device node under a host node"
        node = Node(
            key=key,
            full=full,
            swa=swa,
            hashes=page_hashes(key, p, parent.last_hash),
            parent=parent,
            last_access=self.tick(),
        )
        parent.children[key[:p]] = node
        self.leaves.discard(parent)
        self.leaves.add(node)
        self.full_evictable += len(key)
        if swa is None:
            self.events.emit(EventKind.STORED_FULL_ONLY, node.hashes)
        else:
            self.swa_evictable += len(key)
            self._push_live(node)
            self.events.emit(EventKind.STORED, node.hashes)
        if self.retention is not None:
            self.retention.classify(node)
            self.retention.classify_up(parent)  # its children changed
        return node

    def delete_leaf(self, node: Node) -> None:
        """Detach an unlocked leaf (either tier); the caller frees its slots (device: `full`,
        and with it any live SWA; host: `host_full` and `host_swa`)."""
        assert node.is_leaf and node.full_lock == 0 and not node.is_root, node
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size]]
        if node.full_on_host:
            self.host_leaves.discard(node)
            self.host_full -= len(node)
        else:
            self.leaves.discard(node)
            self.full_evictable -= len(node)
        if node.swa is not None:
            self.swa_evictable -= len(node)
            self.swa_lru.remove(node)
        if node.host_swa is not None:
            self._forget_host_swa(node)
        node.attached = False
        self.events.emit(EventKind.REMOVED, node.hashes)
        if parent.is_root and not parent.children and parent is not self.root:
            del self.roots[parent.last_hash]  # a salt's last node: its root goes too
        self._reclassify_leaf(parent)
        if self.retention is not None:
            self.retention.forget(node)
            self.retention.classify_up(parent)

    def _reclassify_leaf(self, node: Node) -> None:
        """`node`'s children changed: its place in the device or host leaf order."""
        if node.is_root:
            return
        if node.full_on_host:
            if node.is_leaf:
                self.host_leaves.add(node)
        elif node.full_lock == 0 and node.is_device_leaf:
            self.leaves.add(node)
        else:
            self.leaves.discard(node)

    def tombstone(self, node: Node) -> None:
        """Drop the SWA component; the caller frees SWA of `node.full`."""
        assert node.swa is not None and node.swa_lock == 0 and not node.pinned, node
        assert self.window is not None, "no SWA rule: nothing may be tombstoned"
        node.swa = None
        self.swa_evictable -= len(node)
        self.swa_lru.remove(node)
        self.events.emit(EventKind.SWA_REMOVED, node.hashes)
        if self.retention is not None:
            self.retention.classify_up(node)

    def revive(self, node: Node, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor | None:
        """Give a device node without device SWA fresh SWA (and maybe new full slots: unlocked
        revival). Its host SWA, if any, is superseded: returned for the caller to free."""
        assert node.swa is None and node.swa_lock == 0 and not node.full_on_host, node
        old = node.host_swa
        if old is not None:
            self._forget_host_swa(node)
        node.full, node.swa = full, swa
        self.swa_evictable += len(node)
        self._push_live(node)
        kind = EventKind.SWA_RESTORED if old is None else EventKind.SWA_LOADED
        self.events.emit(kind, node.hashes)
        if self.retention is not None:
            self.retention.classify_up(node)
        return old

    # ---- the host tier (docs/design.md §9.9): the caller moves the slots ------------------

    def offload_swa(self, node: Node, host_swa: torch.Tensor) -> None:
        """Device SWA -> host (LIVE -> SWA_HOST); the caller frees SWA of `node.full`."""
        assert node.swa is not None and node.swa_lock == 0 and not node.pinned, node
        node.swa = None
        self.swa_evictable -= len(node)
        self.swa_lru.remove(node)
        self._hold_host_swa(node, host_swa)
        self.events.emit(EventKind.SWA_OFFLOADED, node.hashes)
        if self.retention is not None:
            self.retention.classify(node)

    def offload(self, node: Node, host_full: torch.Tensor, host_swa: torch.Tensor | None) -> None:
        """A device leaf's full KV -> host, its device SWA with it (`host_swa`: where; None only
        without device SWA). The caller frees `node.full` (and its mapped SWA)."""
        assert node.full_lock == 0 and node.is_device_leaf and not node.pinned, node
        assert (host_swa is None) == (node.swa is None), "device SWA moves with the full KV"
        self.leaves.discard(node)
        self.full_evictable -= len(node)
        if node.swa is not None:
            self.swa_evictable -= len(node)
            self.swa_lru.remove(node)
            node.swa = None
        if host_swa is not None:
            self._hold_host_swa(node, host_swa)
        node.full, node.host_full = _EMPTY, host_full
        self.host_full += len(node)
        self.events.emit(EventKind.OFFLOADED, node.hashes)
        self._reclassify_leaf(node)
        assert node.parent is not None
        self._reclassify_leaf(node.parent)
        if self.retention is not None:
            self.retention.classify(node)

    def load(self, node: Node, full: torch.Tensor) -> torch.Tensor:
        """Host full KV -> the device slots `full` (SWA stays where it is); returns the host
        slots for the caller to free. The parent must be on the device already."""
        assert node.host_full is not None and node.parent is not None, node
        assert not node.parent.full_on_host, "load from the root down"
        old, node.host_full, node.full = node.host_full, None, full
        self.host_full -= len(node)
        self.full_evictable += len(node)
        self.host_leaves.discard(node)
        self.events.emit(EventKind.LOADED, node.hashes)
        self._reclassify_leaf(node)
        self._reclassify_leaf(node.parent)
        return old

    def drop_host_swa(self, node: Node) -> torch.Tensor:
        """Host SWA freed (SWA_HOST -> TOMBSTONE, HOST -> HOST_TOMBSTONE); returns the host
        slots for the caller to free."""
        old = node.host_swa
        assert old is not None and not node.pinned, node
        self._forget_host_swa(node)
        self.events.emit(EventKind.SWA_REMOVED, node.hashes)
        if self.retention is not None:
            self.retention.classify_up(node)
        return old

    def _hold_host_swa(self, node: Node, host_swa: torch.Tensor) -> None:
        node.host_swa = host_swa
        self.host_swa += len(node)
        self.host_swa_order.add(node)

    def _forget_host_swa(self, node: Node) -> None:
        node.host_swa = None
        self.host_swa -= len(node)
        self.host_swa_order.discard(node)

    def _push_live(self, node: Node) -> None:
        self.swa_lru.push_newest(node)
        node.swa_tick = self.tick()

    # ---- access order ---------------------------------------------------------------------

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def touch(self, end: Node, *, hit: bool = False) -> None:
        """Record an access of the path root → `end`: full order (deeper = newer) and a
        window-bounded SWA refresh above `end` (docs/design.md §9.6). `hit`: a match ended at
        `end` (tail-first retention, docs/design.md §9.5)."""
        path = []
        node = end
        while not node.is_root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        for n in reversed(path):
            n.last_access = self.tick()
            # (with a host tier a device leaf may sit above `end`, host nodes below it)
            for order in (self.leaves, self.host_leaves, self.host_swa_order):
                order.touched(n)
        budget = (1 << 62) if self.window is None else self.window + self.page_size
        for n in self.swa_lru.refresh_upward(end, budget):  # top first: the deepest ends newest
            n.swa_tick = self.tick()
            if self.retention is not None:
                self.retention.touched(n)
        if hit and self.retention is not None:
            self.retention.hit(end)

    # ---- locks ----------------------------------------------------------------------------

    def lock(self, node: Node) -> LockReceipt:
        """FULL lock node → root; SWA lock over live nodes until `window` tokens are covered
        (stopping at a tombstone: KV above it cannot serve this match's window anyway)."""
        if node.is_root:
            return LockReceipt(node, None)
        assert node.attached, "lock of an evicted node: lock a match before anything can evict"
        assert not node.full_on_host, "locks hold device KV only: load first"
        self.leaves.discard(node)
        top: Node | None = None
        acc = 0
        swa_open = True
        for n in _up(node):
            if n.full_lock == 0:
                self.full_evictable -= len(n)
                self.full_protected += len(n)
            n.full_lock += 1
            if swa_open and n.swa is not None:
                self._swa_inc(n)
                top = n
                acc += len(n)
                swa_open = self.window is None or acc < self.window
            else:
                swa_open = False
        if top is None:
            return LockReceipt(node, None)
        if top.boundary_id is None:
            top.boundary_id = self._next_boundary_id
            self._next_boundary_id += 1
        return LockReceipt(node, top.boundary_id)

    def unlock(self, receipt: LockReceipt, skip_swa: bool = False) -> None:
        node = receipt.node
        if node.is_root:
            return
        if receipt.holds_swa and not skip_swa:
            self._swa_release(receipt, on_zero=None)
        for n in _up(node):
            assert n.full_lock > 0, f"unlock of an unlocked node {n}: receipt used twice?"
            n.full_lock -= 1
            if n.full_lock == 0:
                self.full_protected -= len(n)
                self.full_evictable += len(n)
        if node.full_lock == 0 and node.attached and node.is_device_leaf:
            self.leaves.add(node)

    def release_window(self, receipt: LockReceipt) -> LockReceipt:
        """Drop the SWA part of a lock: the nodes whose SWA lock hits 0 become SWA-evictable.

        NOTE: nothing is tombstoned here (the unified tree's lazy reclaim, not the legacy
        tree's immediate free of a leaf). Evictable SWA already counts as free in admission
        budgets, so freeing it now buys no capacity; keeping it keeps the prompt's tail window
        live, which is what lets another request reuse the whole prompt. The SWA LRU
        reclaims it under pressure.
        """
        if not receipt.holds_swa:
            return receipt
        self._swa_release(receipt, None)
        return LockReceipt(receipt.node, None)

    def _swa_inc(self, n: Node) -> None:
        if n.swa_lock == 0:
            self.swa_evictable -= len(n)
            self.swa_protected += len(n)
        n.swa_lock += 1

    def _swa_release(self, receipt: LockReceipt, on_zero: Callable[[Node], None] | None) -> None:
        for n in _up(receipt.node):
            assert n.swa is not None and n.swa_lock > 0, f"SWA unlock of {n}: receipt used twice?"
            n.swa_lock -= 1
            if n.swa_lock == 0:
                self.swa_protected -= len(n)
                self.swa_evictable += len(n)
                if on_zero is not None:
                    on_zero(n)
            if n.boundary_id == receipt.swa_boundary:
                return
        raise AssertionError(f"lock boundary {receipt.swa_boundary} not found above {receipt.node}")

    # ---- whole tree -----------------------------------------------------------------------

    def iter_nodes(self) -> list[Node]:
        """Every non-root node under every root (O(n): integrity checks, snapshots, reset)."""
        out: list[Node] = []
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


_EMPTY = torch.empty(0, dtype=torch.int64)


def _up(node: Node) -> list[Node]:
    out = []
    while not node.is_root:
        out.append(node)
        node = node.parent  # type: ignore[assignment]
    return out

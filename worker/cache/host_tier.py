"""`HostTier`: the cache's side of the host tier (docs/design.md §9.9) — where device eviction
sends KV instead of dropping it, the host tier's own LRU eviction, and loads back.

    device eviction                       host tier                      gone
    full phase:  device leaf ──offload──▶ HOST / HOST_TOMBSTONE ──host full LRU──▶ REMOVED
    SWA phase:   live SWA    ──offload──▶ SWA_HOST / HOST      ──host SWA LRU───▶ SWA_REMOVED
                 (no host room: dropped as without a tier)
    admission:   ◀──load── the full KV of the used prefix, the SWA of the window before its end

It owns the host allocator and the transfer queue: each move records its copy there in the
order it is decided (the queue's protocol, `worker/kv/transfer.py`), frees the host slots it
leaves at once and hands the device slots it leaves to the façade (`AllocOps`), which frees them
after the decision. Host eviction takes the least recently used host leaf (its full KV and any
host SWA go) or host SWA (tombstoned), never a node an admission is loading through (`pinned`).
"""

from __future__ import annotations

import torch

from worker.cache.node import Node
from worker.cache.tree import AllocOps, RadixTree
from worker.kv.host_pool import HostAllocator
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.transfer import Move, TransferQueue
from worker.models.spec import LayerKind

FULL, SWA = LayerKind.FULL, LayerKind.SWA


class HostTier:
    def __init__(self, host: HostAllocator, queue: TransferQueue) -> None:
        self.host, self.queue = host, queue
        self.tokens_offloaded = 0  # tokens any of whose KV moved to the host (monotonic)
        self.tokens_loaded = 0  # tokens any of whose KV came back (monotonic)

    # ---- device eviction: offload instead of drop ---------------------------------------------

    def offload_leaf(self, tree: RadixTree, node: Node, ops: AllocOps) -> bool:
        """Move an unlocked device leaf's full KV, and its device SWA, to the host; False
        (nothing changed) when the host full pool cannot take it."""
        n = len(node)
        if not self._room(tree, FULL, n):
            return False
        host_full = self.host.alloc(FULL, n)
        assert host_full is not None
        host_swa = None
        if node.swa is not None:
            host_swa = self.host.alloc(SWA, n) if self._room(tree, SWA, n) else None
            if host_swa is None:
                tree.tombstone(node)  # no host SWA room: the SWA KV goes as without a tier
        self.queue.add(Move.OFFLOAD, FULL, node.full, host_full)
        if host_swa is not None:
            assert node.swa is not None
            self.queue.add(Move.OFFLOAD, SWA, node.swa, host_swa)
        ops.free.append(node.full)
        tree.offload(node, host_full, host_swa)
        self.tokens_offloaded += n
        return True

    def offload_swa(self, tree: RadixTree, node: Node, ops: AllocOps) -> bool:
        """Move a node's device SWA to the host; False when the host SWA pool cannot take it."""
        n = len(node)
        if node.swa is None or not self._room(tree, SWA, n):
            return False
        host_swa = self.host.alloc(SWA, n)
        assert host_swa is not None
        self.queue.add(Move.OFFLOAD, SWA, node.swa, host_swa)
        ops.free_swa.append(node.full)
        tree.offload_swa(node, host_swa)
        self.tokens_offloaded += n
        return True

    def drop_below(self, tree: RadixTree, node: Node) -> None:
        """Delete every host node under `node` (a device leaf being dropped), deepest first."""
        for child in list(node.children.values()):
            self.drop_below(tree, child)
            self._delete(tree, child)

    # ---- the host tier's own eviction ---------------------------------------------------------

    def evict(self, tree: RadixTree, full_tokens: int, swa_tokens: int) -> None:
        """Free host slots until this many are free per kind, if unpinned content allows."""
        self._room(tree, FULL, full_tokens)
        self._room(tree, SWA, swa_tokens)

    def _room(self, tree: RadixTree, kind: LayerKind, tokens: int) -> bool:
        """Evict the host kind's least recently used content until `tokens` are free."""
        if tokens > self.host.size(kind):
            return False
        order = tree.host_leaves if kind is FULL else tree.host_swa_order
        skipped: list[Node] = []
        while self.host.available(kind) < tokens:
            node = order.pop_oldest()
            if node is None:
                break
            if node.pinned:
                skipped.append(node)
            elif kind is FULL:
                self._delete(tree, node)
            else:
                self.host.free(SWA, tree.drop_host_swa(node))
        for node in skipped:
            order.add(node)
        return self.host.available(kind) >= tokens

    def _delete(self, tree: RadixTree, node: Node) -> None:
        assert node.host_full is not None and node.is_leaf, node
        full, swa = node.host_full, node.host_swa
        tree.delete_leaf(node)
        self.host.free(FULL, full)
        if swa is not None:
            self.host.free(SWA, swa)

    # ---- admission: load back -----------------------------------------------------------------

    def load_full(self, tree: RadixTree, device: HybridAllocator, node: Node) -> bool:
        """Host full KV of `node` -> fresh device full pages (its SWA stays where it is)."""
        assert node.host_full is not None
        full = device.alloc_full(len(node))
        if full is None:
            return False
        self.queue.add(Move.LOAD, FULL, full, node.host_full)
        self.host.free(FULL, tree.load(node, full))
        return True

    def load_swa(self, tree: RadixTree, device: HybridAllocator, node: Node) -> bool:
        """Host SWA KV of a device-full `node` -> fresh device SWA pages (SWA_HOST -> LIVE)."""
        assert node.host_swa is not None and not node.full_on_host
        swa = device.attach_swa(node.full)
        if swa is None:
            return False
        self.queue.add(Move.LOAD, SWA, swa, node.host_swa)
        old = tree.revive(node, node.full, swa)
        assert old is not None
        self.host.free(SWA, old)
        return True

    def free(self, ops: AllocOps) -> None:
        """Host slots a tree operation left (an insert or a repair superseded them)."""
        for kind, slots in ops.host_free:
            self.host.free(kind, slots)

    def free_all(self, nodes: list[Node]) -> None:
        """Every host slot of these nodes (the cache is being emptied)."""
        for n in nodes:
            for kind, slots in ((FULL, n.host_full), (SWA, n.host_swa)):
                if slots is not None:
                    self.host.free(kind, slots)
        self.queue.clear()


def host_slots(nodes: list[Node], kind: LayerKind) -> torch.Tensor:
    """Every host slot of one kind these nodes hold (integrity checks)."""
    parts = [n.host_full if kind is FULL else n.host_swa for n in nodes]
    held = [p for p in parts if p is not None]
    return torch.cat(held) if held else torch.empty(0, dtype=torch.int64)

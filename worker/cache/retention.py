"""Tail-first retention: which live SWA a future match can need, and which is *interior*
(docs/design.md §9.5).

A match ends where a request diverged from the tree or where an insert ended: at a **leaf** or
at a **branch point** (a node with two or more children). Such an end needs only the window
before it, T = `RadixTree.tail` tokens, and those tokens may reach up into single-child
ancestors when the end node is shorter than T. So a live node n keeps

    keep(n) = min(len(n), T − D(n))    (0 when D(n) ≥ T)
    D(n)    = 0                         n is a leaf or a branch point
            = len(c) + D(c)            n's one child c is live
            = ∞                         n's one child is a tombstone (no match below reads n)

tokens at its end; the `len(n) − keep(n)` tokens before them are interior. A single-child node
whose chain reaches no end within T (the head the insert cap split off, an earlier turn of a
conversation, the chunks of a long prefill) is interior as a whole::

    leaf / branch:   [====== interior ======|== keep T ==]
    chain:           [==== interior (all) ====] ─ [= 4 =|= keep T−4 =] ─ [leaf, 4 tokens]

Among the tails, those no match has ended at yet (*on probation*: the user turn of a one-off
request, a chat's latest leaf) go before those a match ended at (a tenant's system prompt, a
fork point), least recently used first in each group, as segmented LRU caches do: a reused end
is the best predictor of the next reuse.

`TailRetention` keeps the nodes that hold interior SWA, and the live nodes on probation, in two
heaps by `swa_tick` (their place in the SWA LRU), so SWA eviction takes the least recently used
of each without scanning. keep() walks at most T/P nodes down; a change at a node re-classifies
the ancestors within T above it (at most T/P of them).
"""

from __future__ import annotations

from worker.cache.lru import NodeHeap
from worker.cache.node import Node


def _swa_tick(node: Node) -> int:
    return node.swa_tick


class TailRetention:
    def __init__(self, tail: int) -> None:
        self.tail = tail
        self.interior = NodeHeap(_swa_tick)  # live nodes with keep(n) < len(n)
        self.probation = NodeHeap(_swa_tick)  # live nodes no match has ended at

    def keep(self, node: Node) -> int:
        """Tokens at the end of live `node` that a match ending at or below it may need."""
        dist, cur = 0, node
        while len(cur.children) == 1:
            (child,) = cur.children.values()
            if not child.has_swa:  # (SWA on the host still serves a match: §9.9)
                return 0
            dist += len(child)
            if dist >= self.tail:
                return 0
            cur = child
        return min(len(node), self.tail - dist)

    def is_interior(self, node: Node) -> bool:
        return node.swa is not None and not node.is_root and self.keep(node) < len(node)

    def classify(self, node: Node) -> None:
        """Update `node`'s memberships after its state, length, children or hit changed."""
        _member(self.interior, node, self.is_interior(node))
        _member(self.probation, node, node.swa is not None and not node.swa_hit)

    def forget(self, node: Node) -> None:
        """`node` left the tree."""
        self.interior.discard(node)
        self.probation.discard(node)

    def hit(self, node: Node) -> None:
        """A match ended at `node`: its tail leaves probation."""
        if not node.is_root:
            node.swa_hit = True
            self.probation.discard(node)

    def classify_up(self, node: Node | None) -> None:
        """`node` changed (children, liveness): re-classify it and the ancestors whose keep()
        walks through it, i.e. those within T above it."""
        dist = 0
        while node is not None and not node.is_root and dist < self.tail:
            self.classify(node)
            dist += len(node)
            node = node.parent

    def touched(self, node: Node) -> None:
        """`node.swa_tick` changed."""
        self.interior.touched(node)
        self.probation.touched(node)


def _member(heap: NodeHeap, node: Node, want: bool) -> None:
    if not want:
        heap.discard(node)
    elif node not in heap:
        heap.add(node)

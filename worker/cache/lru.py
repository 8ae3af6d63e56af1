"""Eviction orders: the SWA LRU list and the full-eviction heap of unlocked leaves.

* `LRUList` — intrusive doubly linked list over the nodes that hold live SWA KV (O(1) push,
  remove, move; links live on the node). SWA eviction walks it from the oldest end.
* `NodeHeap` — member nodes ordered by a key, with lazy deletion: a stale entry (node no
  longer a member, or touched since) is skipped when popped. `LeafHeap` holds the unlocked
  leaves by `last_access`: full eviction pops from it, so it never scans locked or internal
  nodes. Tail-first retention keeps the interior nodes in one by `swa_tick` (retention.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from worker.cache.node import Node


class LRUList:
    """Newest at `newest`, oldest at `oldest`; the links are `Node.lru_newer/lru_older`."""

    def __init__(self) -> None:
        self.newest: Node | None = None
        self.oldest: Node | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, node: Node) -> bool:
        return node.in_lru

    def push_newest(self, node: Node) -> None:
        assert not node.in_lru, "node already in the LRU list"
        node.lru_older, node.lru_newer = self.newest, None
        if self.newest is not None:
            self.newest.lru_newer = node
        self.newest = node
        if self.oldest is None:
            self.oldest = node
        node.in_lru = True
        self.size += 1

    def insert_older_than(self, anchor: Node, node: Node) -> None:
        """Put `node` right behind `anchor` (used by split: the upper part is not newer)."""
        assert anchor.in_lru and not node.in_lru
        older = anchor.lru_older
        node.lru_newer, node.lru_older = anchor, older
        anchor.lru_older = node
        if older is not None:
            older.lru_newer = node
        else:
            self.oldest = node
        node.in_lru = True
        self.size += 1

    def remove(self, node: Node) -> None:
        assert node.in_lru, "node not in the LRU list"
        newer, older = node.lru_newer, node.lru_older
        if newer is not None:
            newer.lru_older = older
        else:
            self.newest = older
        if older is not None:
            older.lru_newer = newer
        else:
            self.oldest = newer
        node.lru_newer = node.lru_older = None
        node.in_lru = False
        self.size -= 1

    def move_to_newest(self, node: Node) -> None:
        if self.newest is not node:
            self.remove(node)
            self.push_newest(node)

    def refresh_upward(self, node: Node, budget: int) -> list[Node]:
        """Refresh `node` and its ancestors within `budget` tokens above it (the crossing node
        included); nodes outside the list are skipped but their length counts. The deepest
        node ends newest. `budget <= 0` is a no-op. Returns the refreshed nodes, top first.

        NOTE: bounded on purpose — refreshing the whole path would keep out-of-window
        ancestors hot, so SWA eviction would hit a branch's tail window first.
        """
        if budget <= 0:
            return []
        chain: list[Node] = []
        acc = 0
        cur: Node | None = node
        while cur is not None and cur.parent is not None:
            if cur.in_lru:
                chain.append(cur)
            acc += len(cur.key)
            if acc >= budget:
                break
            cur = cur.parent
        chain.reverse()
        for n in chain:
            self.move_to_newest(n)
        return chain

    def iter_oldest(self) -> Iterator[Node]:
        """Oldest first. Safe against removing the node just yielded."""
        cur = self.oldest
        while cur is not None:
            nxt = cur.lru_newer
            yield cur
            cur = nxt

    def order_newest_first(self) -> list[Node]:
        out: list[Node] = []
        cur = self.newest
        while cur is not None:
            out.append(cur)
            cur = cur.lru_older
        return out


def _last_access(node: Node) -> int:
    return node.last_access


class NodeHeap:
    """Member nodes by `key(node)` (smallest = least recent), lazy deletion: re-key a member
    with `touched` after its key changed."""

    def __init__(self, key: Callable[[Node], int]) -> None:
        self.key = key
        self.members: set[Node] = set()
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = 0  # tie-breaker so nodes are never compared

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, node: Node) -> bool:
        return node in self.members

    def add(self, node: Node) -> None:
        self.members.add(node)
        self._push(node)

    def discard(self, node: Node) -> None:
        self.members.discard(node)  # its heap entries go stale

    def touched(self, node: Node) -> None:
        """Re-key a member after its `last_access` changed."""
        if node in self.members:
            self._push(node)

    def pop_oldest(self) -> Node | None:
        while self._heap:
            t, _, node = heapq.heappop(self._heap)
            if node in self.members and self.key(node) == t:
                self.members.remove(node)
                return node
        return None

    def clear(self) -> None:
        self.members.clear()
        self._heap.clear()

    def _push(self, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.key(node), self._seq, node))
        # Stale entries pile up when members are touched often; rebuild at 2x (amortised O(1)).
        if len(self._heap) > 2 * len(self.members) + 64:
            self._heap = [(self.key(n), i, n) for i, n in enumerate(self.members)]
            self._seq = len(self._heap)
            heapq.heapify(self._heap)

    def valid_entries(self) -> set[int]:
        """Integrity helper (O(heap)): ids of members with an up-to-date entry."""
        return {id(n) for t, _, n in self._heap if n in self.members and t == self.key(n)}


class LeafHeap(NodeHeap):
    """Unlocked leaves by `last_access` (the full-eviction order)."""

    def __init__(self) -> None:
        super().__init__(_last_access)

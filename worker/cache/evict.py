"""Eviction: FULL phase over the leaf heap, then SWA phase over the SWA LRU (docs/design.md §9.5).

* FULL: pop the least recently used unlocked leaf, delete it (its full slots and any live SWA
  go back), then delete ancestors that became childless, unlocked *tombstones* (they hold only
  full KV nobody can match without a live descendant). A parent that becomes an unlocked leaf
  joins the heap. Stops once `full_tokens` are freed or nothing unlocked is left.
* SWA: walk the SWA LRU from the oldest end, skipping SWA-locked nodes, until `swa_tokens`
  are freed (SWA freed by the FULL phase counts): an unlocked leaf is deleted whole; an
  internal node or a full-locked leaf is tombstoned in place (its full KV stays).

Cost: O(log n) per deleted leaf (heap), O(1) per tombstoned node, plus skipped SWA-locked
nodes (bounded by the running requests' windows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.cache.node import Node
from worker.cache.tree import AllocOps, RadixTree


@dataclass(slots=True)
class _Tally:
    full: int = 0
    swa: int = 0
    ops: AllocOps = field(default_factory=AllocOps)


def evict(tree: RadixTree, full_tokens: int, swa_tokens: int) -> tuple[int, int, AllocOps]:
    """Returns (full tokens freed, SWA tokens freed, allocator work)."""
    tally = _Tally()
    while tally.full < full_tokens:
        leaf = tree.leaves.pop_oldest()
        if leaf is None:
            break
        _delete_with_tombstone_ancestors(tree, leaf, tally)
    if tree.window is not None and tally.swa < swa_tokens:
        for node in tree.swa_lru.iter_oldest():
            if tally.swa >= swa_tokens:
                break
            if node.swa_lock > 0:
                continue
            if node.is_leaf and node.full_lock == 0:
                _delete_with_tombstone_ancestors(tree, node, tally)
            else:
                tree.tombstone(node)
                tally.ops.free_swa.append(node.full)
                tally.swa += len(node)
    return tally.full, tally.swa, tally.ops


def _delete_with_tombstone_ancestors(tree: RadixTree, leaf: Node, tally: _Tally) -> None:
    parent = leaf.parent
    _delete(tree, leaf, tally)
    # NOTE: only SWA-*less* ancestors cascade; a live parent stays (it is matchable itself).
    while (
        parent is not None
        and not parent.is_root
        and parent.is_leaf
        and parent.swa is None
        and parent.full_lock == 0
    ):
        grand = parent.parent
        _delete(tree, parent, tally)
        parent = grand


def _delete(tree: RadixTree, node: Node, tally: _Tally) -> None:
    tally.full += len(node)
    if node.swa is not None:
        tally.swa += len(node)
    tally.ops.free.append(node.full)
    tree.delete_leaf(node)

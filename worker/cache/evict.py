"""Eviction: FULL phase over the leaf heap, then SWA phase over the SWA LRU (docs/design.md §9.5).

* FULL: pop the least recently used unlocked leaf, delete it (its full slots and any live SWA
  go back), then delete ancestors that became childless, unlocked *tombstones* (they hold only
  full KV nobody can match without a live descendant). A parent that becomes an unlocked leaf
  joins the heap. Stops once `full_tokens` are freed or nothing unlocked is left.
* SWA (`lru`, the SGLang order): walk the SWA LRU from the oldest end, skipping SWA-locked
  nodes, until `swa_tokens` are freed (SWA freed by the FULL phase counts): an unlocked leaf is
  deleted whole; an internal node or a full-locked leaf is tombstoned in place (its full KV
  stays).
* SWA (`tail_first`): a match ends at a leaf or a branch point and needs only the window
  before it, so first the *interior* goes (retention.py): the least recently used SWA-unlocked
  node holding interior SWA is split at ``len − keep`` and its head tombstoned, its last `keep`
  tokens stay live. Only when no unlocked interior SWA is left is a tail taken, tombstoned in
  place (full KV kept: a repair can rebuild its SWA, docs/design.md §9.8): the oldest
  SWA-unlocked one no match has ended at, else the oldest SWA-unlocked live node::

      leaf [=========== head ===========|== T ==]   →   [tombstone (SWA_REMOVED) ][== T ==]

With a host tier (`tier`, docs/design.md §9.9) every phase offloads what it would drop: a
device leaf's full KV (and its device SWA) moves to the host, SWA — interior and tails, under
either policy — moves to the host instead of being tombstoned; only what the host tier cannot
take is dropped as above. A device leaf is a node whose full KV is on the device and none of
its children's (without a tier: a leaf). Nodes an admission is loading through (`pinned`) are
skipped like SWA-locked ones.

Cost: O(log n) per deleted leaf or interior head (heaps), O(T/P) re-classification per
tombstone, plus skipped SWA-locked nodes (bounded by the running requests' windows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.cache.host_tier import HostTier
from worker.cache.node import Node
from worker.cache.retention import TailRetention
from worker.cache.tree import AllocOps, RadixTree


@dataclass(slots=True)
class _Tally:
    tier: HostTier | None
    full: int = 0
    swa: int = 0
    ops: AllocOps = field(default_factory=AllocOps)


def evict(
    tree: RadixTree, full_tokens: int, swa_tokens: int, tier: HostTier | None = None
) -> tuple[int, int, AllocOps]:
    """Returns (device full tokens freed, device SWA tokens freed, allocator work)."""
    tally = _Tally(tier)
    while tally.full < full_tokens:
        leaf = tree.leaves.pop_oldest()
        if leaf is None:
            break
        _take_leaf(tree, leaf, tally)
    if tree.window is None or tally.swa >= swa_tokens:
        return tally.full, tally.swa, tally.ops
    if tree.retention is None:
        _swa_lru_phase(tree, swa_tokens, tally)
        return tally.full, tally.swa, tally.ops
    # NOTE: a tail that goes can make interior of the ancestors above it (nothing below
    # reads them any more), so the interior runs dry again before each further tail.
    while tally.swa < swa_tokens:
        _interior_phase(tree, tree.retention, swa_tokens, tally)
        if tally.swa >= swa_tokens or not _one_tail(tree, tree.retention, tally):
            break
    return tally.full, tally.swa, tally.ops


def _swa_lru_phase(tree: RadixTree, swa_tokens: int, tally: _Tally) -> None:
    for node in tree.swa_lru.iter_oldest():
        if tally.swa >= swa_tokens:
            break
        if node.swa_lock > 0 or node.pinned:
            continue
        if node.full_lock == 0 and node.is_device_leaf:
            _take_leaf(tree, node, tally)
        else:
            _tombstone(tree, node, tally)


def _interior_phase(
    tree: RadixTree, retention: TailRetention, swa_tokens: int, tally: _Tally
) -> None:
    locked: list[Node] = []
    while tally.swa < swa_tokens:
        node = retention.interior.pop_oldest()
        if node is None:
            break
        if node.swa_lock > 0 or node.pinned:
            locked.append(node)
            continue
        keep = retention.keep(node)
        head = node if keep == 0 else tree.split(node, len(node) - keep)
        _tombstone(tree, head, tally)  # SWA_REMOVED for exactly the head's pages
    for node in locked:  # still interior: back in the heap at their own tick
        retention.interior.add(node)


def _one_tail(tree: RadixTree, retention: TailRetention, tally: _Tally) -> bool:
    """Tombstone one tail: the least recently used SWA-unlocked node on probation, else the
    least recently used SWA-unlocked live node; False when there is none."""
    locked: list[Node] = []
    node = retention.probation.pop_oldest()
    while node is not None and (node.swa_lock > 0 or node.pinned):
        locked.append(node)
        node = retention.probation.pop_oldest()
    for n in locked:
        retention.probation.add(n)
    if node is not None:
        _tombstone(tree, node, tally)
        return True
    for node in tree.swa_lru.iter_oldest():
        if node.swa_lock == 0 and not node.pinned:
            _tombstone(tree, node, tally)
            return True
    return False


def _tombstone(tree: RadixTree, node: Node, tally: _Tally) -> None:
    """Device SWA goes: to the host tier when it takes it, else freed."""
    tally.swa += len(node)
    if tally.tier is not None and tally.tier.offload_swa(tree, node, tally.ops):
        return
    tree.tombstone(node)
    tally.ops.free_swa.append(node.full)


def _take_leaf(tree: RadixTree, leaf: Node, tally: _Tally) -> None:
    """A device leaf's KV goes: to the host tier when it takes it, else deleted (with what
    hangs below it on the host, and its childless tombstone ancestors)."""
    tally.full += len(leaf)
    if leaf.swa is not None:
        tally.swa += len(leaf)
    if tally.tier is not None:
        if tally.tier.offload_leaf(tree, leaf, tally.ops):
            return
        tally.tier.drop_below(tree, leaf)
    _delete_with_tombstone_ancestors(tree, leaf, tally)


def _delete_with_tombstone_ancestors(tree: RadixTree, leaf: Node, tally: _Tally) -> None:
    parent = leaf.parent
    tally.ops.free.append(leaf.full)
    tree.delete_leaf(leaf)
    # NOTE: only SWA-*less* ancestors cascade; a live parent stays (it is matchable itself).
    while (
        parent is not None
        and not parent.is_root
        and parent.is_leaf
        and not parent.has_swa
        and parent.full_lock == 0
    ):
        grand = parent.parent
        _delete(tree, parent, tally)
        parent = grand


def _delete(tree: RadixTree, node: Node, tally: _Tally) -> None:
    tally.full += len(node)
    tally.ops.free.append(node.full)
    tree.delete_leaf(node)

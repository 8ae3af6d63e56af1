"""Insert a request's page-aligned KV into the tree (docs/design.md §9.3).

Inputs: `key` (page-aligned token ids), `full` (the request's full slots for it), `swa`
(``translate(full)``: its SWA slots, 0 where already freed), `prev_prefix_len` (the request's
`cache_protected_len`: below it the request's slots *are* the tree's) and `swa_evicted`
(the request's frontier: below it the request has no live SWA).

For each matched node covering ``[pos, pos+k)`` (split to the key first):

    lo = max(pos, prev_prefix_len)      request-owned part starts here
    live_from = max(lo, swa_evicted)    the request has live SWA from here

    node live                 -> free the request's duplicates [lo, pos+k)
    node tombstone, live_from >= pos+k
                              -> keep the tombstone, free duplicates [lo, pos+k) (full only)
    node tombstone, live_from <  pos+k
                              -> split at live_from; the lower part is revived with the
                                 request's KV; free duplicates [lo, live_from)

Revival of an unlocked tombstone frees its old full slots and adopts the request's; of a
full-locked one (another request reads those slots) keeps the node's full slots, points their
mapping at the request's SWA slots and frees only the request's full slots.

The unmatched suffix ``[pos, n)`` becomes a tombstone node ``[pos, swa_evicted)`` (if the
frontier is inside it) then a live leaf, capped to one page-aligned window (the part above the
cap becomes its parent). If the whole suffix is out of window it becomes one FULL-only leaf
(the unified tree's choice: full KV stays reusable, e.g. for a later revival).

The key goes under the root of `root_hash` (a request's cache salt's, docs/design.md §9.10),
created by the first non-empty key under it.

A matched node whose KV is on the host tier (docs/design.md §9.9) adopts the request's device
KV instead (`_adopt`): the request just computed it, so it is loaded without a copy. A node with
device full KV and host SWA is revived like a tombstone (its host SWA superseded, SWA_LOADED).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.events import ROOT_HASH
from worker.cache.node import Key, Node
from worker.cache.tree import AllocOps, RadixTree
from worker.models.spec import LayerKind


@dataclass(frozen=True)
class InsertOutcome:
    prefix_len: int  # tokens of the key that were already in the tree
    node: Node  # the node that ends the key (the root for an empty key)
    ops: AllocOps  # slots for the façade to free / remap


def insert(
    tree: RadixTree,
    key: Key,
    full: torch.Tensor,
    swa: torch.Tensor,
    *,
    prev_prefix_len: int,
    swa_evicted: int,
    root_hash: int = ROOT_HASH,
) -> InsertOutcome:
    p = tree.page_size
    n = len(key)
    assert n % p == 0 and len(full) == n == len(swa), (n, len(full), len(swa), p)
    assert prev_prefix_len % p == 0 and swa_evicted % p == 0, (prev_prefix_len, swa_evicted, p)
    if tree.window is None:
        swa_evicted = 0  # no SWA rule: nothing is ever out of window
    ops = AllocOps()
    # (an empty key makes no root: a salt's root exists only while it has children)
    node, pos = (tree.root_for(root_hash) if n else tree.root), 0
    while pos < n:
        child = tree.child(node, key, pos)
        if child is None:
            break
        k = tree.common_len(child, key, pos)
        if k < len(child):
            child = tree.split(child, k)
        node = _overlap(tree, child, pos, full, swa, prev_prefix_len, swa_evicted, ops)
        pos += k
    prefix_len = pos
    if pos < n:
        assert pos >= prev_prefix_len, (
            f"the tree lost part of the request's protected prefix ({pos} < {prev_prefix_len}):"
            " the request must hold its lock until it is cached"
        )
        node = _add_suffix(tree, node, key, full, swa, pos, swa_evicted)
    tree.touch(node)
    return InsertOutcome(prefix_len, node, ops)


def _overlap(
    tree: RadixTree,
    node: Node,
    pos: int,
    full: torch.Tensor,
    swa: torch.Tensor,
    prev: int,
    evicted: int,
    ops: AllocOps,
) -> Node:
    """Handle one matched node covering [pos, pos+len(node)); returns the node ending there."""
    end = pos + len(node)
    lo = max(pos, prev)
    if lo >= end:
        return node  # shared: the request's slots are the tree's
    live_from = max(lo, evicted)
    if node.full_on_host:
        assert lo == pos, "a host node inside the request's locked prefix"
        return _adopt(tree, node, pos, full, swa, live_from, ops)
    if node.swa is not None or live_from >= end:
        ops.free.append(full[lo:end])
        return node
    if live_from > pos:
        tree.split(node, live_from - pos)  # upper part stays a tombstone
    if live_from > lo:
        ops.free.append(full[lo:live_from])
    _revive(tree, node, full[live_from:end], swa[live_from:end], ops)
    return node


def _revive(
    tree: RadixTree, node: Node, req_full: torch.Tensor, req_swa: torch.Tensor, ops: AllocOps
) -> None:
    assert bool((req_swa > 0).all()), (
        "reviving with SWA slots the request no longer owns: its swa_evicted_seqlen is stale"
    )
    if node.full_lock == 0:
        ops.free.append(node.full)  # a tombstone's mapping is 0: frees full only
        _superseded(tree.revive(node, req_full, req_swa), ops)
        return
    # NOTE: another request reads node.full right now; freeing it would corrupt that request.
    ops.remap.append((node.full, req_swa))
    ops.remap.append((req_full, torch.zeros_like(req_full)))
    ops.free.append(req_full)  # its mapping is zeroed first, so only the full slots go
    _superseded(tree.revive(node, node.full, req_swa), ops)


def _adopt(
    tree: RadixTree,
    node: Node,
    pos: int,
    full: torch.Tensor,
    swa: torch.Tensor,
    live_from: int,
    ops: AllocOps,
) -> Node:
    """A node whose full KV is on the host and that the request recomputed: the request's
    device KV becomes the node's (LOADED, then SWA_LOADED / SWA_RESTORED where the request
    has live SWA), the host copies are freed. No request locks a host node, so the request
    owns every slot here (`pos >= prev_prefix_len`)."""
    end = pos + len(node)
    if pos < live_from < end:
        upper = tree.split(node, live_from - pos)  # stays without the request's SWA
        ops.host_free.append((LayerKind.FULL, tree.load(upper, full[pos:live_from])))
        pos = live_from
    ops.host_free.append((LayerKind.FULL, tree.load(node, full[pos:end])))
    if live_from < end:
        _superseded(tree.revive(node, node.full, swa[pos:end]), ops)
    return node


def _superseded(host_swa: torch.Tensor | None, ops: AllocOps) -> None:
    if host_swa is not None:
        ops.host_free.append((LayerKind.SWA, host_swa))


def _add_suffix(
    tree: RadixTree,
    parent: Node,
    key: Key,
    full: torch.Tensor,
    swa: torch.Tensor,
    pos: int,
    evicted: int,
) -> Node:
    n = len(key)
    if evicted >= n:
        return tree.add_node(parent, key[pos:], full[pos:], None)
    if evicted > pos:
        parent = tree.add_node(parent, key[pos:evicted], full[pos:evicted], None)
        pos = evicted
    leaf = tree.add_node(parent, key[pos:], full[pos:], swa[pos:])
    tail = tree.tail
    if tail is not None and len(leaf) > tail:
        # NOTE: a long leaf would be SWA-locked whole by a request that matches it; only its
        # last window matters for the next query (docs/design.md §9.3).
        tree.split(leaf, len(leaf) - tail)
    return leaf


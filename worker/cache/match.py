"""Prefix match with the window validity rule (docs/design.md §1, §9.2).

A match may end at a node only if the SWA layers have the KV the next query needs:
no tombstone lies on the path root → node, or at least `window` contiguous live tokens follow
the last tombstone. The live run resets to 0 at *every* tombstone (a short run between two
tombstones never adds up with later tokens). When the deepest matched node is not valid the
match falls back to the deepest earlier valid node. Cost: O(path length) node visits plus
the key comparison.

    path:   A(live 3) ─ T(tomb 4) ─ B(live 2) ─ C(live 2)        window = 4
    run:        3          0           2           4
    valid:      ✓          ✗           ✗           ✓   → match ends at C (all 11 tokens)

With a host tier (docs/design.md §9.9) SWA KV on the host counts as live for the rule (`valid`),
and the same walk finds the deepest match that needs no load (`device`: full KV and the live
run on the device only), so the caller can price loading the difference.

A walk starts at the root of the request's root hash (its cache salt's, docs/design.md §9.10);
a salt with no root yet matches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.events import ROOT_HASH
from worker.cache.node import Key, Node
from worker.cache.tree import RadixTree

_NO_TOMBSTONE = 1 << 62  # the run before any tombstone: every window is satisfied


@dataclass(frozen=True, slots=True)
class Walk:
    """One walk of a key down the tree (tokens; docs/design.md §9.2, §9.9).

    `path` ends at the deepest valid match over device ∪ host SWA (`valid` tokens); its first
    `device_nodes` nodes end at the deepest valid match that needs no load (`device` tokens).
    `full`: tokens present on either tier (tombstones and a partially matched last node
    included); `host_full_all`: of those, tokens whose full KV is on the host."""

    path: list[Node]
    valid: int
    device_nodes: int
    device: int
    full: int
    host_full_all: int


def match_path(
    tree: RadixTree, key: Key, *, window_rule: bool = True, root_hash: int = ROOT_HASH
) -> tuple[list[Node], int]:
    """Nodes of the accepted match (root-side first) and its length in tokens.

    `key` must be page-aligned. A partially matched last node is split only when the match
    may end inside it. `window_rule=False` gives the plain full-KV match (what the tree holds,
    used to re-find a just-inserted key, and the path a repair locks).
    """
    walk = match_walk(tree, key, window_rule=window_rule, root_hash=root_hash)
    return walk.path, walk.valid


def match_walk(
    tree: RadixTree, key: Key, *, window_rule: bool = True, root_hash: int = ROOT_HASH
) -> Walk:
    """The walk of `key`: both valid matches (a node is split where they end inside it) and
    the full-KV match, unsplit (what a repair could start from, §9.8)."""
    window = tree.window if window_rule else None
    path: list[Node] = []
    best_nodes = best_len = dev_nodes = dev_len = host_full = 0
    root = tree.roots.get(root_hash)
    if root is None:
        return Walk(path, 0, 0, 0, 0, 0)
    node, pos, run, run_dev, dev_ok = root, 0, _NO_TOMBSTONE, _NO_TOMBSTONE, True
    while pos < len(key):
        child = tree.child(node, key, pos)
        if child is None:
            break
        k = tree.common_len(child, key, pos)
        run = run + k if child.has_swa else 0  # SWA on either tier serves the window
        run_dev = run_dev + k if child.swa is not None else 0
        dev_ok = dev_ok and not child.full_on_host
        host_full += k if child.full_on_host else 0
        valid = window is None or run >= window
        valid_dev = dev_ok and (window is None or run_dev >= window)  # implies `valid`
        if k < len(child):
            if valid:
                path.append(tree.split(child, k))
                best_nodes, best_len = len(path), pos + k
                if valid_dev:
                    dev_nodes, dev_len = len(path), pos + k
            return Walk(path[:best_nodes], best_len, dev_nodes, dev_len, pos + k, host_full)
        path.append(child)
        pos += k
        node = child
        if valid:
            best_nodes, best_len = len(path), pos
        if valid_dev:
            dev_nodes, dev_len = len(path), pos
    return Walk(path[:best_nodes], best_len, dev_nodes, dev_len, pos, host_full)

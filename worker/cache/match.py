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
"""

from __future__ import annotations

from worker.cache.node import Key, Node
from worker.cache.tree import RadixTree

_NO_TOMBSTONE = 1 << 62  # the run before any tombstone: every window is satisfied


def match_path(tree: RadixTree, key: Key, *, window_rule: bool = True) -> tuple[list[Node], int]:
    """Nodes of the accepted match (root-side first) and its length in tokens.

    `key` must be page-aligned. A partially matched last node is split only when the match
    may end inside it. `window_rule=False` gives the plain full-KV match (what the tree holds,
    used to re-find a just-inserted key, and the path a repair locks).
    """
    path, length, _ = match_walk(tree, key, window_rule=window_rule)
    return path, length


def match_walk(
    tree: RadixTree, key: Key, *, window_rule: bool = True
) -> tuple[list[Node], int, int]:
    """`match_path` plus the full-KV match length (tokens present, tombstones included; a
    partially matched last node counts, unsplit): what a repair could start from (§9.8)."""
    window = tree.window if window_rule else None
    path: list[Node] = []
    best_nodes = best_len = 0
    node, pos, run = tree.root, 0, _NO_TOMBSTONE
    while pos < len(key):
        child = tree.child(node, key, pos)
        if child is None:
            break
        k = tree.common_len(child, key, pos)
        run = run + k if child.swa is not None else 0
        valid = window is None or run >= window
        if k < len(child):
            if valid:
                path.append(tree.split(child, k))
                best_nodes, best_len = len(path), pos + k
            return path[:best_nodes], best_len, pos + k
        path.append(child)
        pos += k
        node = child
        if valid:
            best_nodes, best_len = len(path), pos
    return path[:best_nodes], best_len, pos

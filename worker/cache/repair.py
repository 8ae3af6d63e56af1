"""Revival of a repaired tail window (docs/design.md §9.8).

A repairing request recomputed positions ``[start, end)`` (``end = p_full``, the end of its
FULL-locked match) into *scratch* slots: fresh full/SWA pairs of its own, not in the tree. Their
SWA KV is exact at every SWA layer over the tail ``[end − T, end)`` (T = one window tail,
`RadixTree.tail`). Afterwards, along the path that ends at ``end``::

    [start ......................... end − T ............... end)
     scratch: freed                  | tombstone → revived with the scratch SWA (SWA_RESTORED)
                                     | live      → keeps its own SWA; the scratch pair is freed

The node crossing ``end − T`` is split there first. Every node on the path is FULL-locked by the
request, so revival keeps the node's full slots and re-points their mapping at the scratch SWA
slots (as a locked revival does on insert, §9.3); the adopted scratch full slots are unmapped
before all scratch full slots are freed (which frees the SWA of the non-adopted ones with them).
"""

from __future__ import annotations

import torch

from worker.cache.node import Node, path_to_root
from worker.cache.tree import AllocOps, RadixTree
from worker.models.spec import LayerKind


def revive_tail(
    tree: RadixTree, end_node: Node, start: int, scratch: torch.Tensor, scratch_swa: torch.Tensor
) -> AllocOps:
    """Revive the tombstones of the last T tokens before `end_node`'s end (see above).

    `scratch` holds the request's scratch full slots of positions ``[start, end)`` and
    `scratch_swa` their SWA slots (``translate(scratch)``). Returns the allocator work.
    """
    assert tree.tail is not None, "no window: nothing is ever tombstoned"
    path = path_to_root(end_node)  # deepest first
    end = start + len(scratch)
    assert sum(len(n) for n in path) == end, "the repair's lock no longer ends at its p_full"
    lo = max(start, end - tree.tail)
    ops = AllocOps()
    pos = end
    for node in path:
        if pos <= lo:
            break
        first = pos - len(node)
        if first < lo:
            tree.split(node, lo - first)  # `node` keeps [lo, pos)
            first = lo
        if node.swa is None:
            assert node.full_lock > 0, "a repair's path must stay FULL-locked"
            part = slice(first - start, pos - start)
            ops.remap.append((node.full, scratch_swa[part]))
            ops.remap.append((scratch[part], torch.zeros_like(scratch[part])))
            host_swa = tree.revive(node, node.full, scratch_swa[part])
            if host_swa is not None:  # SWA_HOST: the host copy is superseded (§9.9)
                ops.host_free.append((LayerKind.SWA, host_swa))
        pos = first
    ops.free.append(scratch)  # adopted pairs are unmapped above: only their full slots go
    tree.touch(end_node)
    return ops

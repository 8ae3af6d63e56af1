"""`check_tree`: recount everything the tree keeps incrementally (docs/design.md §12).

O(nodes + slots): for tests and for an idle scheduler, never on the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import torch

from core.events import ROOT_HASH, page_hashes
from worker.cache.host_tier import host_slots
from worker.models.spec import LayerKind

if TYPE_CHECKING:
    from worker.cache.host_tier import HostTier
    from worker.cache.node import Node
    from worker.cache.req_kv import ReqKV
    from worker.cache.tree import RadixTree
    from worker.kv.hybrid_allocator import HybridAllocator


def _fail(msg: str) -> NoReturn:
    raise AssertionError(f"radix cache integrity: {msg}")


def check_tree(
    tree: RadixTree,
    allocator: HybridAllocator,
    running: Sequence[ReqKV] = (),
    tier: HostTier | None = None,
) -> None:
    """Raise AssertionError naming the first broken invariant."""
    _check_roots(tree)
    nodes = tree.iter_nodes()
    for n in nodes:
        _check_node(tree, n)
        _check_tiers(n, tier)
    _check_counters(tree, nodes)
    _check_orders(tree, nodes)
    _check_slots(tree, allocator, nodes)
    allocator.check_integrity()
    if tier is not None:
        _check_host(tier, nodes)
    if running:
        _check_pools(tree, allocator, running)


def _check_roots(tree: RadixTree) -> None:
    """One root per root hash, each filed under its own hash (docs/design.md §9.10); a salt's
    root goes with its last node, so only the unsalted root may be empty."""
    if tree.roots.get(ROOT_HASH) is not tree.root:
        _fail("the unsalted root is not filed under ROOT_HASH")
    for h, root in tree.roots.items():
        if root.parent is not None or root.key or root.hashes != [h]:
            _fail(f"root {h:#x} is not a root of its own hash")
        if (root.full_lock, root.swa_lock) != (1, 1):
            _fail(f"root {h:#x}: locks {root.full_lock}/{root.swa_lock}, roots stay locked once")
        if not root.children and root is not tree.root:
            _fail(f"root {h:#x}: a salt's root without nodes was kept")


def _check_node(tree: RadixTree, n: Node) -> None:
    p = tree.page_size
    parent = n.parent
    if parent is None or parent.children.get(n.key[:p]) is not n or not n.attached:
        _fail(f"{n} is not reachable from its parent under its first page")
    slots = len(n.full) if n.host_full is None else len(n.host_full)
    if not n.key or len(n.key) % p or slots != len(n.key):
        _fail(f"{n}: key of {len(n.key)} tokens / {slots} slots is not page aligned")
    if n.swa is not None and len(n.swa) != len(n.key):
        _fail(f"{n}: {len(n.swa)} SWA slots for {len(n.key)} tokens")
    if not n.full_lock >= n.swa_lock >= 0:
        _fail(f"{n}: lock counts must satisfy full >= swa >= 0")
    if n.swa is None and (n.swa_lock or tree.window is None):
        _fail(f"{n}: a tombstone must hold no SWA lock and exists only with a window")
    if n.hashes != page_hashes(n.key, p, parent.last_hash):
        _fail(f"{n}: page hashes are not chained from its parent")


def _check_tiers(n: Node, tier: HostTier | None) -> None:
    """Where each component lives (docs/design.md §9.9): one tier per component, host nodes
    unlocked with only host nodes below, nothing pinned outside an admission."""
    if tier is None and (n.host_full is not None or n.host_swa is not None):
        _fail(f"{n}: host slots without a host tier")
    if n.pinned:
        _fail(f"{n}: still pinned after an admission")
    if n.swa is not None and n.host_swa is not None:
        _fail(f"{n}: SWA KV on both tiers")
    if n.host_swa is not None and len(n.host_swa) != len(n.key):
        _fail(f"{n}: {len(n.host_swa)} host SWA slots for {len(n.key)} tokens")
    if n.full_on_host and (len(n.full) or n.swa is not None or n.full_lock):
        _fail(f"{n}: full KV on the host but device slots or a lock too")
    if not n.full_on_host and n.parent is not None and n.parent.full_on_host:
        _fail(f"{n}: device KV below a node whose full KV is on the host")


def _check_host(tier: HostTier, nodes: list[Node]) -> None:
    """Host allocator free + held == total per kind; no host slot held twice."""
    tier.host.check_integrity()
    for kind in LayerKind:
        held = host_slots(nodes, kind)
        if torch.unique(held).numel() != held.numel() or bool((held <= 0).any()):
            _fail(f"a host {kind.value} slot is held by two nodes (or is a dummy slot)")
        used = tier.host.size(kind) - tier.host.available(kind)
        if used != held.numel():
            _fail(f"host {kind.value} pool: {used} tokens allocated but nodes hold {held.numel()}")


def _check_counters(tree: RadixTree, nodes: list[Node]) -> None:
    hf = sum(len(n) for n in nodes if n.full_on_host)
    hs = sum(len(n) for n in nodes if n.host_swa is not None)
    if (tree.host_full, tree.host_swa) != (hf, hs):
        _fail(f"host counters (full, swa) {(tree.host_full, tree.host_swa)} != recount {(hf, hs)}")
    fe = fp = se = sp = 0
    for n in nodes:
        if n.full_on_host:
            continue
        if n.full_lock:
            fp += len(n)
        else:
            fe += len(n)
        if n.swa is not None:
            if n.swa_lock:
                sp += len(n)
            else:
                se += len(n)
    got = (tree.full_evictable, tree.full_protected, tree.swa_evictable, tree.swa_protected)
    if got != (fe, fp, se, sp):
        _fail(f"counters (full ev/prot, swa ev/prot) {got} != recount {(fe, fp, se, sp)}")


def _check_orders(tree: RadixTree, nodes: list[Node]) -> None:
    live = {n for n in nodes if n.swa is not None}
    order = tree.swa_lru.order_newest_first()
    if len(order) != tree.swa_lru.size or set(order) != live or len(order) != len(live):
        _fail(f"SWA LRU holds {len(order)} nodes, {len(live)} live nodes exist")
    for newer, older in zip(order, order[1:]):
        if newer.lru_older is not older or older.lru_newer is not newer:
            _fail("SWA LRU links are not symmetric")
    ret = tree.retention
    if ret is not None:
        interior = {n for n in live if ret.keep(n) < len(n)}
        if ret.interior.members != interior:
            _fail(f"interior heap holds {len(ret.interior)} nodes, {len(interior)} are interior")
        keyed = ret.interior.valid_entries()
        if any(id(n) not in keyed for n in interior):
            _fail("an interior node has no up-to-date entry in the interior heap")
        probation = {n for n in live if not n.swa_hit}
        if ret.probation.members != probation or not {id(n) for n in probation} <= ret.probation.valid_entries():
            _fail(f"probation heap holds {len(ret.probation)} nodes, {len(probation)} are on probation")
    leaves = {n for n in nodes if n.is_device_leaf and n.full_lock == 0}
    if tree.leaves.members != leaves:
        _fail(f"leaf heap members ({len(tree.leaves)}) != unlocked device leaves ({len(leaves)})")
    keyed = tree.leaves.valid_entries()
    if any(id(n) not in keyed for n in leaves):
        _fail("an unlocked leaf has no up-to-date entry in the leaf heap")
    host_leaves = {n for n in nodes if n.full_on_host and n.is_leaf}
    host_swa = {n for n in nodes if n.host_swa is not None}
    for heap, want, what in ((tree.host_leaves, host_leaves, "host leaf"),
                             (tree.host_swa_order, host_swa, "host SWA")):  # fmt: skip
        if heap.members != want or not {id(n) for n in want} <= heap.valid_entries():
            _fail(f"{what} order holds {len(heap)} nodes (up to date?), {len(want)} qualify")


def _check_slots(tree: RadixTree, allocator: HybridAllocator, nodes: list[Node]) -> None:
    nodes = [n for n in nodes if not n.full_on_host]  # (host slots: `_check_host`)
    if not nodes:
        return
    full = torch.cat([n.full for n in nodes])
    if torch.unique(full).numel() != full.numel() or bool((full <= 0).any()):
        _fail("a full slot is held by two nodes (or is a dummy slot)")
    for n in nodes:
        mapped = allocator.translate(n.full)
        if n.swa is None:
            if bool((mapped != 0).any()):
                _fail(f"{n}: a tombstone still maps SWA slots (reviving it would free them)")
        elif not torch.equal(mapped, n.swa) or bool((n.swa <= 0).any()):
            _fail(f"{n}: SWA component disagrees with the allocator mapping")


def _check_pools(tree: RadixTree, allocator: HybridAllocator, running: Sequence[ReqKV]) -> None:
    """I9: per pool, total == free + evictable + protected + request-owned."""
    P = tree.page_size
    owned_full = sum(r.owned_full_tokens(P) for r in running)
    full = allocator.full_available_size() + tree.full_evictable + tree.full_protected + owned_full
    if full != allocator.full_size:
        _fail(
            f"full pool: free {allocator.full_available_size()} + evictable {tree.full_evictable}"
            f" + protected {tree.full_protected} + request-owned {owned_full} = {full}"
            f" != total {allocator.full_size} (a leak or a double count)"
        )
    if not allocator.hybrid:
        return
    owned_swa = sum(r.owned_swa_tokens(P) for r in running)
    swa = allocator.swa_available_size() + tree.swa_evictable + tree.swa_protected + owned_swa
    if swa != allocator.swa_size:
        _fail(
            f"SWA pool: free {allocator.swa_available_size()} + evictable {tree.swa_evictable}"
            f" + protected {tree.swa_protected} + request-owned {owned_swa} = {swa}"
            f" != total {allocator.swa_size} (a leak or a double count)"
        )

"""Tree node: a page-aligned run of tokens with its FULL and SWA components.

A node owns `len(key)` tokens. Its FULL component is `full` (full-pool slots, one per token);
its SWA component is `swa` (SWA-pool slots, ``translate(full)`` at the time the node got them)
or None: an SWA *tombstone* — the full KV is still valid, the SWA KV was freed.

With a host tier (docs/design.md §9.9) each component may live on the host instead:
`host_full` (host full slots; then `full` is empty) and `host_swa` (host SWA slots; then `swa`
is None). A node whose full KV is on the host has no KV on the device, and its descendants
are on the host too (device-resident nodes are a top part of the tree). `state` names the five
combinations as `core.events.PageState` does.
`hashes` holds the chained page hashes of its pages (docs/design.md §4.3); a split slices it.
A root holds one: its root hash, where its chain starts (ROOT_HASH, or a cache salt's: a tree
has a root per salt in use, docs/design.md §9.10).

Nothing here touches an allocator; the tree (`tree.py`) keeps the counters and LRUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.events import ROOT_HASH, PageState

Key = tuple[int, ...]

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False, slots=True)
class Node:
    """One node of the radix tree. Identity-hashed (used as a set/dict member)."""

    key: Key
    full: torch.Tensor  # int64, CPU: full-pool slot per token
    swa: torch.Tensor | None  # int64, CPU: SWA-pool slot per token; None = tombstone
    hashes: list[int]  # chained page hash per page (a root: [its root hash])
    parent: Node | None = None
    children: dict[Key, Node] = field(default_factory=dict)  # keyed by the child's first page
    host_full: torch.Tensor | None = None  # int64, CPU: host full slots (full KV on the host)
    host_swa: torch.Tensor | None = None  # int64, CPU: host SWA slots (SWA KV on the host)
    pinned: bool = False  # an admission is loading through it: no eviction takes it (§9.9)
    full_lock: int = 0  # requests holding this node's full KV
    swa_lock: int = 0  # requests holding this node's SWA KV (<= full_lock)
    boundary_id: int | None = None  # set on the topmost SWA-locked node of some lock
    last_access: int = 0  # tick of the cache's logical clock (full-eviction order)
    swa_tick: int = 0  # tick of its last move to the SWA LRU's newest end (interior order)
    swa_hit: bool = False  # a match has ended here (tail-first retention keeps such tails longer)
    attached: bool = True  # False once deleted from the tree
    # Intrusive links of the SWA LRU list (lru.py); `in_lru` says whether they are meaningful.
    lru_newer: Node | None = None
    lru_older: Node | None = None
    in_lru: bool = False

    @staticmethod
    def make_root(root_hash: int = ROOT_HASH) -> Node:
        # The root is permanently locked so walks that stop "at a locked node" stop there.
        return Node(key=(), full=_EMPTY, swa=_EMPTY, hashes=[root_hash], full_lock=1, swa_lock=1)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_tombstone(self) -> bool:
        return self.swa is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def full_on_host(self) -> bool:
        return self.host_full is not None

    @property
    def has_swa(self) -> bool:
        """SWA KV exists on some tier: the window rule counts the node as live."""
        return self.swa is not None or self.host_swa is not None

    @property
    def is_device_leaf(self) -> bool:
        """Full KV on the device, none of its children's: what device full eviction takes."""
        return not self.full_on_host and all(c.full_on_host for c in self.children.values())

    @property
    def state(self) -> PageState:
        if self.full_on_host:
            return PageState.HOST if self.host_swa is not None else PageState.HOST_TOMBSTONE
        if self.swa is not None:
            return PageState.LIVE
        return PageState.SWA_HOST if self.host_swa is not None else PageState.TOMBSTONE

    @property
    def last_hash(self) -> int:
        """Chained hash of the prefix ending at this node (a root: its root hash)."""
        return self.hashes[-1]

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:  # keep reprs short: tensors and parents would recurse
        return f"Node(len={len(self.key)}, {self.state.value}, lock={self.full_lock}/{self.swa_lock})"


def split_off_head(node: Node, at: int, page_size: int) -> Node:
    """Cut `node` at token offset `at` and return the new upper node holding ``key[:at]``.

    `node` keeps the lower part (so every handle pointing at it stays valid). The upper node
    copies both lock counts (every lock through `node` also runs through it) and takes the lock
    boundary id: the boundary of a lock is its *topmost* SWA-locked node.
    The caller fixes counters-free bookkeeping (LRU position, leaf heap); sizes don't change.
    ::

        parent ── node[0:len)          parent ── upper[0:at) ── node[at:len)
    """
    assert 0 < at < len(node.key) and at % page_size == 0, (at, len(node.key), page_size)
    parent = node.parent
    assert parent is not None, "cannot split the root"
    pages = at // page_size
    upper = Node(
        key=node.key[:at],
        full=node.full[:at],
        swa=None if node.swa is None else node.swa[:at],
        host_full=None if node.host_full is None else node.host_full[:at],
        host_swa=None if node.host_swa is None else node.host_swa[:at],
        pinned=node.pinned,
        hashes=node.hashes[:pages],
        parent=parent,
        full_lock=node.full_lock,
        swa_lock=node.swa_lock,
        boundary_id=node.boundary_id,
        last_access=node.last_access,
        swa_tick=node.swa_tick,
    )
    node.boundary_id = None
    node.key = node.key[at:]
    node.full = node.full[at:]
    node.swa = None if node.swa is None else node.swa[at:]
    node.host_full = None if node.host_full is None else node.host_full[at:]
    node.host_swa = None if node.host_swa is None else node.host_swa[at:]
    node.hashes = node.hashes[pages:]
    parent.children[upper.key[:page_size]] = upper
    upper.children[node.key[:page_size]] = node
    node.parent = upper
    return upper


def path_to_root(node: Node) -> list[Node]:
    """Nodes from `node` up to (excluding) the root, deepest first."""
    out: list[Node] = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out

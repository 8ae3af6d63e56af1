"""The prefix-cache interface the scheduler codes against, and its result types.

Vocabulary (worker/cache/README.md): page, slot, pool, allocator, table, tree, node,
component (FULL / SWA view of a node), tombstone (a node whose SWA KV was freed, full kept),
handle (a locked match, here a `LockReceipt`), frontier (`ReqKV.swa_evicted_seqlen`).

Two implementations: `RadixCache` (radix_cache.py) and `ChunkCache` (chunk_cache.py, radix
disabled). Both free KV only through the allocator they were given, and read a request's
`ReqKV` without writing it: a request hook returns a `KVUpdate` the scheduler records.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from core.events import ROOT_HASH, CacheEvent, PageState
from core.reuse import TieredMatch

if TYPE_CHECKING:
    from worker.cache.node import Node
    from worker.cache.req_kv import ReqKV


@dataclass(frozen=True)
class MatchResult:
    """A prefix match. `indices` are FULL-pool slots (int64, CPU), tombstoned spans included;
    `length == len(indices)` is page-aligned; `node` ends the match (the root when 0).

    `length` is the window-valid match; `full_length` (≥ `length`) counts every token whose
    FULL KV is cached, tombstones included: the `p_full` of a repair (docs/design.md §9.8).
    With a host tier (docs/design.md §9.9) `length`, `indices` and `node` are the match that
    needs no load (`p_device`), and `tiered` says what the tiers hold (None: no host tier).
    """

    indices: torch.Tensor
    length: int
    node: Node
    full_length: int = 0
    tiered: TieredMatch | None = None


@dataclass(frozen=True)
class LoadPlan:
    """A load in preparation (`RadixCache.prepare_load`): the path is pinned and its device
    part locked by `receipt` until `load` or `cancel_load`. `full_tokens` / `swa_tokens`: the
    device tokens per pool the load takes; `tokens`: prompt tokens any of whose KV it loads."""

    path: tuple[Node, ...]
    receipt: LockReceipt | None
    full_nodes: tuple[Node, ...]
    swa_nodes: tuple[Node, ...]
    full_tokens: int
    swa_tokens: int
    tokens: int


@dataclass(frozen=True)
class LockReceipt:
    """What `lock` took; hand it back to `unlock` / `release_window_lock` unchanged.

    `swa_boundary` is the lock-boundary id carried by the topmost SWA-locked node (it moves to
    the upper part when that node is split); None when no SWA lock was taken.
    """

    node: Node
    swa_boundary: int | None

    @property
    def holds_swa(self) -> bool:
        return self.swa_boundary is not None


@dataclass(frozen=True)
class KVUpdate:
    """What a request hook decided about the request's KV, every field as it is from now on; the
    scheduler writes it into the request's `ReqKV` (the one writer of request state).

    `tree_slots`: the tree's full slots for ``[previous cache_protected_len, cache_protected_len)``
    (int64, CPU), where the request's table re-points (None: the protected prefix did not grow).
    `repair_done`: the repair's scratch slots are gone (into the tree or back to the pool).
    """

    lock: LockReceipt | None
    swa_lock_released: bool
    cache_protected_len: int
    swa_evicted_seqlen: int
    tree_slots: torch.Tensor | None = None
    repair_done: bool = False


@dataclass(frozen=True)
class EvictResult:
    """Tokens actually freed per pool (may exceed the request: node granularity)."""

    full: int
    swa: int


class PrefixCache(abc.ABC):
    """Prefix semantics over a hybrid allocator. Sizes are tokens.

    Eight operations below; the sizes (`full_evictable`, `swa_evictable`: held only by the
    cache; `full_protected`, `swa_protected`: held by locks), `drain_events`, `snapshot_pages`
    and `reset` have no-tree defaults that `RadixCache` overrides.
    """

    @abc.abstractmethod
    def match_prefix(self, tokens: Sequence[int], root_hash: int = ROOT_HASH) -> MatchResult:
        """Longest cached, page-aligned prefix of `tokens` usable for the next query.

        Args: tokens — the prompt (the engine passes all but the last prompt token);
            root_hash — the request's cache salt's (`SamplingParams.root_hash`): only what
            requests of the same salt inserted matches (docs/design.md §9.10).
        Returns: the match; with SWA, it ends only where the window rule holds (README §match).
        Mutates: may split a node; refreshes LRU order. Locks nothing.
        """

    @abc.abstractmethod
    def lock(self, node: Node) -> LockReceipt:
        """Protect a matched prefix from eviction: FULL from `node` to the root, SWA only over
        the last `window` live tokens. Returns the receipt `unlock` needs."""

    @abc.abstractmethod
    def unlock(self, receipt: LockReceipt, skip_swa: bool = False) -> None:
        """Undo `lock`. `skip_swa=True` drops only the FULL part (after `release_window_lock`,
        whose returned receipt already says so). Never frees KV."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: ReqKV) -> KVUpdate:
        """Chunked prefill: insert the page-aligned filled part `[0, floor_P(kv_committed_len))`
        and lock the new end node (the old lock released). Frees the request's duplicate slots.
        Returns: the tree's slots for the newly protected part (the table re-points there), the
        new lock and `cache_protected_len`, the frontier (eager SWA freeing may move it)."""

    @abc.abstractmethod
    def cache_finished_req(self, req: ReqKV, insert: bool = True) -> KVUpdate:
        """Finish: insert (or not) the page-aligned committed part, free every slot of the
        request the tree did not take (unaligned tail, over-allocation and repair scratch
        included), unlock. Returns an update with no lock: the request owns nothing now."""

    @abc.abstractmethod
    def release_window_lock(self, receipt: LockReceipt) -> LockReceipt:
        """Early release: a decoding request past the window no longer needs its prefix's SWA.
        Drops the SWA part of `receipt` (nodes whose SWA lock reaches 0 become SWA-evictable;
        nothing is freed until SWA eviction picks them) and returns the FULL-only receipt.
        Call at most once per lock."""

    @abc.abstractmethod
    def evict(self, full_tokens: int, swa_tokens: int) -> EvictResult:
        """Free at least this many tokens per pool if unlocked cache content allows it.
        SWA freed by the FULL phase counts toward `swa_tokens`."""

    @abc.abstractmethod
    def check_integrity(self, running_reqs: Sequence[ReqKV] = ()) -> None:
        """Raise AssertionError naming the first broken invariant (README §integrity); given
        the running requests also the pool identity free + evictable + protected + owned = total."""

    # ---- defaults for a cache without a tree (ChunkCache); RadixCache overrides them ----
    full_evictable: int = 0
    swa_evictable: int = 0
    full_protected: int = 0
    swa_protected: int = 0

    def drain_events(self) -> list[CacheEvent]:
        """Cache events since the last drain, in order (events.py)."""
        return []

    def snapshot_pages(self) -> dict[int, PageState]:
        """Every cached page by chained hash → LIVE / TOMBSTONE (for a consumer's resync)."""
        return {}

    def reset(self) -> None:
        """Flush: free everything unlocked (the engine calls it when idle)."""
        return None

    def match_full(self, tokens: Sequence[int], root_hash: int = ROOT_HASH) -> MatchResult:
        """The full-KV match (tombstones included), ending at a node: what a repair locks."""
        return self.match_prefix(tokens, root_hash)

    def prepare_load(
        self, tokens: Sequence[int], length: int, swa_from: int | None, root_hash: int = ROOT_HASH
    ) -> LoadPlan:
        """Host tier (docs/design.md §9.9): pin the cached prefix `tokens[:length]` and lock its
        device part; the plan says what loading it (SWA from `swa_from` on) takes per pool."""
        raise NotImplementedError(f"{type(self).__name__} has no host tier")

    def load(self, plan: LoadPlan) -> MatchResult:
        """Load a prepared plan (room made): returns the device match of its prefix."""
        raise NotImplementedError(f"{type(self).__name__} has no host tier")

    def cancel_load(self, plan: LoadPlan) -> None:
        """Release a prepared plan without loading."""
        raise NotImplementedError(f"{type(self).__name__} has no host tier")

    def finish_repair(self, req: ReqKV) -> KVUpdate:
        """A repair's rows are computed (docs/design.md §9.8): revive the tombstoned pages of
        the tail window before `cache_protected_len` with the request's private SWA slots, free
        the rest of them, and move the lock so it SWA-protects that tail (the update's)."""
        raise NotImplementedError(f"{type(self).__name__} has no tombstones to repair")

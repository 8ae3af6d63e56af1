"""`ChunkCache`: the cache when the radix cache is disabled (docs/design.md §10.3).

No tree: nothing is shared or reused, every slot stays the request's until it finishes.
The request's SWA frontier covers ``[0, swa_evicted_seqlen)`` (nothing is tree-owned); freeing
the whole table at finish is safe because `free_swa` skips the already-unmapped hole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.events import ROOT_HASH
from core.geometry import Geometry
from worker.cache.base import EvictResult, KVUpdate, LockReceipt, MatchResult, PrefixCache
from worker.cache.node import Node
from worker.cache.req_kv import ReqKV
from worker.kv.hybrid_allocator import HybridAllocator


class ChunkCache(PrefixCache):
    """Same hooks as `RadixCache`; matches are always empty and nothing is evictable."""

    def __init__(self, allocator: HybridAllocator, geometry: Geometry) -> None:
        if geometry.page_size != allocator.page_size:
            raise ValueError(
                f"page_size {geometry.page_size} != the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.geometry = geometry
        self._root = Node.make_root()

    def match_prefix(self, tokens: Sequence[int], root_hash: int = ROOT_HASH) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), 0, self._root)

    def lock(self, node: Node) -> LockReceipt:
        return LockReceipt(node, None)

    def unlock(self, receipt: LockReceipt, skip_swa: bool = False) -> None:
        return None

    def release_window_lock(self, receipt: LockReceipt) -> LockReceipt:
        return receipt

    def cache_unfinished_req(self, req: ReqKV) -> KVUpdate:
        # The filled part stays the request's own: nothing to insert, nothing to re-point.
        assert req.cache_protected_len == 0, "a chunk-cache request owns its whole table"
        return KVUpdate(req.lock, req.swa_lock_released, 0, req.swa_evicted_seqlen)

    def cache_finished_req(self, req: ReqKV, insert: bool = True) -> KVUpdate:
        end = max(req.kv_committed_len, req.kv_allocated_len)
        if end > 0:
            # NOTE: [0, swa_evicted_seqlen) has no SWA any more; free() finds its mapping
            # zeroed and frees only the full slots there.
            self.allocator.free(req.table[:end])
        return KVUpdate(None, False, 0, req.swa_evicted_seqlen)

    def evict(self, full_tokens: int, swa_tokens: int) -> EvictResult:
        return EvictResult(0, 0)

    def check_integrity(self, running_reqs: Sequence[ReqKV] = ()) -> None:
        a = self.allocator
        a.check_integrity()
        if not running_reqs:
            return
        P = self.geometry.page_size
        full = a.full_available_size() + sum(r.owned_full_tokens(P) for r in running_reqs)
        assert full == a.full_size, f"chunk cache: full pool free + owned {full} != {a.full_size}"
        if a.hybrid:
            swa = a.swa_available_size() + sum(r.owned_swa_tokens(P) for r in running_reqs)
            assert swa == a.swa_size, f"chunk cache: SWA pool free + owned {swa} != {a.swa_size}"

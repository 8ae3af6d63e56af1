"""Builders for cache tests: a cache over a real allocator and a tiny request driver."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.events import ROOT_HASH, PageState, page_hashes
from core.geometry import Geometry
from core.reuse import TierCosts, choose_reuse
from worker.cache.host_tier import HostTier
from worker.cache.insert import InsertOutcome
from worker.cache.match import match_path
from worker.cache.node import Node
from worker.cache.radix_cache import RadixCache
from worker.cache.req_kv import ReqKV
from worker.kv.frontier import free_out_of_window
from worker.kv.host_pool import HostAllocator
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.transfer import TransferQueue

# The policy `make_cache` uses when none is given (conftest's `both_policies` switches it).
DEFAULT_SWA_POLICY = "lru"
COSTS = TierCosts(prefill=1.0, load_full=0.01, load_swa=0.01)  # loading always pays here


def make_cache(
    page_size: int = 1,
    window: int | None = 4,
    full: int = 128,
    swa: int = 64,
    *,
    hybrid: bool = True,
    eager_swa_free: bool = False,
    swa_eviction_policy: str | None = None,
    host: tuple[int, int] | None = None,
) -> RadixCache:
    """A radix cache over a real allocator; pool sizes in tokens; `host`: a host tier of
    (full, SWA) tokens (its copies are queued, never run: nothing reads KV here)."""
    allocator = HybridAllocator(full, swa, page_size, hybrid)
    tier = None
    if host is not None:
        tier = HostTier(HostAllocator(host[0], host[1], page_size), TransferQueue(allocator))
    return RadixCache(
        allocator,
        Geometry(page_size, window),
        eager_swa_free=eager_swa_free,
        swa_eviction_policy=swa_eviction_policy or DEFAULT_SWA_POLICY,
        tier=tier,
    )


def put(
    cache: RadixCache,
    tokens: Sequence[int],
    *,
    prev: int = 0,
    evicted: int = 0,
    free_evicted_swa: bool = True,
    root: int = ROOT_HASH,
) -> tuple[InsertOutcome, torch.Tensor]:
    """Insert `tokens` with fresh slots (the tree's own slots below `prev`) under `root`'s root.

    With `evicted` > 0 the fresh slots' SWA below `evicted` is freed first, as the request's
    frontier would have done.
    """
    a = cache.allocator
    path, _ = match_path(cache.tree, tuple(tokens[:prev]), window_rule=False, root_hash=root)
    head = torch.cat([torch.empty(0, dtype=torch.int64)] + [n.full for n in path])
    assert len(head) == prev, f"the tree does not hold the first {prev} tokens"
    fresh = a.alloc(len(tokens) - prev)
    assert fresh is not None, "test pool too small"
    values = torch.cat([head, fresh])
    if evicted > prev and free_evicted_swa:
        a.free_swa(values[prev:evicted])
    out = cache.insert(tokens, values, prev_prefix_len=prev, swa_evicted_seqlen=evicted, root_hash=root)
    return out, values


def node_at(cache: RadixCache, tokens: Sequence[int]) -> Node:
    """The node ending exactly at `tokens` (no window rule, no LRU refresh)."""
    node, pos = cache.tree.root, 0
    key = tuple(tokens)
    while pos < len(key):
        child = cache.tree.child(node, key, pos)
        assert child is not None and child.key == key[pos : pos + len(child)], "no such node"
        node, pos = child, pos + len(child)
    return node


def states(cache: RadixCache, tokens: list[int], root: int = ROOT_HASH) -> list[PageState | None]:
    """The snapshot's state of each page of `tokens` under `root`'s chain (None: not cached)."""
    pages = cache.snapshot_pages()
    return [pages.get(h) for h in page_hashes(tokens, cache.page_size, root)]


def load_all(cache: RadixCache, tokens: list[int], root: int = ROOT_HASH) -> int:
    """Match `tokens` and load what `choose_reuse` says (room made by eviction); the reuse."""
    m = cache.match_prefix(tokens, root)
    assert m.tiered is not None
    g = Geometry(cache.page_size, cache.window, 2)
    reuse = choose_reuse(m.tiered, g, COSTS, repair=False)
    if not (reuse.loaded_full or reuse.loaded_swa):
        return m.length
    assert cache.window is not None
    plan = cache.prepare_load(tokens, reuse.reused, reuse.reused - g.ceil(cache.window), root)
    a = cache.allocator
    cache.evict(max(0, plan.full_tokens - a.full_available_size()),
                max(0, plan.swa_tokens - a.swa_available_size()))  # fmt: skip
    assert (plan.full_tokens, plan.swa_tokens) == (reuse.loaded_full, reuse.loaded_swa)
    if a.full_available_size() < plan.full_tokens or a.swa_available_size() < plan.swa_tokens:
        cache.cancel_load(plan)  # locked elsewhere: no room (the scheduler waits or recomputes)
        return cache.match_prefix(tokens, root).length
    return cache.load(plan).length


# ---- a minimal request driver (what the engine does around the hooks) -------------------------


def start_req(
    cache: RadixCache, tokens: Sequence[int], *, match: bool = True, root: int = ROOT_HASH
) -> ReqKV | None:
    """Match (all but the last token), lock, allocate the rest; None if the pools are full."""
    tokens = list(tokens)
    if match:
        m = cache.match_prefix(tokens[:-1], root)
        indices, length, receipt = m.indices, m.length, cache.lock(m.node)
    else:
        indices, length, receipt = torch.empty(0, dtype=torch.int64), 0, None
    new = _alloc(cache, [length], [len(tokens)], [-1])
    if new is None:
        if receipt is not None:
            cache.unlock(receipt)
        return None
    return ReqKV(
        tokens=tokens,
        root_hash=root,
        table=torch.cat([indices, new]),
        cache_protected_len=length,
        lock=receipt,
        kv_committed_len=len(tokens),
        kv_allocated_len=len(tokens),
    )


def decode(cache: RadixCache, req: ReqKV, new_tokens: Sequence[int]) -> bool:
    """Append tokens one decode step each; False (nothing changed for that token) on OOM."""
    for t in new_tokens:
        n = req.kv_allocated_len
        slot = _alloc(cache, [n], [n + 1], [int(req.table[n - 1])], decode=True)
        if slot is None:
            return False
        req.table = torch.cat([req.table[:n], slot])
        req.tokens.append(int(t))
        req.kv_allocated_len = req.kv_committed_len = n + 1
    return True


def move_frontier(cache: RadixCache, req: ReqKV) -> int:
    """The decode-time out-of-window pass (docs/design.md §7, radix formula)."""
    assert cache.window is not None
    req.swa_evicted_seqlen = free_out_of_window(
        cache.allocator,
        req.table,
        cache.geometry,
        evicted=req.swa_evicted_seqlen,
        protected=req.cache_protected_len,
        pre_len=req.kv_committed_len - 1,
        chunk_cache=False,
    )
    return req.swa_evicted_seqlen


def _alloc(
    cache: RadixCache, prefix: list[int], seq: list[int], last: list[int], decode: bool = False
) -> torch.Tensor | None:
    a = cache.allocator
    P = cache.page_size
    need = sum(-(-s // P) - -(-p // P) for p, s in zip(prefix, seq)) * P
    if a.full_available_size() < need or a.swa_available_size() < need:
        cache.evict(max(0, need - a.full_available_size()), max(0, need - a.swa_available_size()))
    last = [x if p % P else -1 for x, p in zip(last, prefix)]
    if decode:
        return a.alloc_decode(seq, last)
    return a.alloc_extend(prefix, seq, last)

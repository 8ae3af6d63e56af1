"""`Scheduler`: which requests run this step, and with how many tokens each.

Policy (mixed batches, decode first):
1. every decoding request feeds its one token (SWA out of its window is freed first, per
   request, once `swa_eviction_interval` tokens left the window since its last free);
   when the pools cannot take the decode tokens even after evicting the tree and freeing
   everything already out of the window, the most recently admitted requests are retracted
   (KV freed, requeued) until they can;
2. requests still prefilling get their next chunk, then waiting requests are admitted, while
   the step's prefill budget (`chunked_prefill_size` tokens) lasts and within both pools'
   budgets (reference §2.16): full = free + evictable − what running requests will still take;
   SWA = free + evictable − the decode headroom running requests keep. An extend is charged
   max(min(e, chunk), W) + P SWA tokens; one too large for the SWA budget starts with a capped
   chunk instead of blocking the queue; a continuing chunk with no SWA room is deferred;
   with nothing running, the queue head gets at least the chunk the SWA pool physically
   holds (nothing would ever free more).

The scheduler decides and allocates; the engine runs the batch and finishes requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.cache.base import PrefixCache
from worker.cache.req_kv import ReqKV
from worker.kv.frontier import free_out_of_window
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.pages import ceil_page
from worker.scheduler.budget import chunk_cap, full_admits, swa_admission_charge
from worker.scheduler.request import Req, ReqState

# Decode tokens a running request is assumed to still need, at most (SGLang clips the same way):
# beyond this, retraction handles the rare request that really runs that long.
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class StepWork:
    """One scheduled request: feed `tokens[start:start+n]`."""

    req: Req
    start: int
    n: int
    decode: bool = False  # a decoding request's one token (else a prefill chunk)

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.req.num_tokens


@dataclass(frozen=True)
class SchedulerLimits:
    page_size: int
    window: int | None  # None: no SWA pool to budget (single pool or no SWA layer)
    chunked_prefill_size: int
    max_running_requests: int
    swa_eviction_interval: int
    radix: bool  # False: chunk cache (frees SWA before each chunk with the exact window)


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        allocator: HybridAllocator,
        cache: PrefixCache,
        on_retract: Callable[[Req], None],
    ) -> None:
        self.limits = limits
        self.allocator = allocator
        self.cache = cache
        self.on_retract = on_retract
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order
        self.retractions = 0
        self.evicted = {"full": 0, "swa": 0}  # tokens the tree gave up to make room, per pool

    # ---- budgets --------------------------------------------------------------------------------
    def _decode_reserve(self, req: Req) -> int:
        left = req.params.max_tokens - len(req.output)
        return min(max(left, 0), CLIP_MAX_NEW_TOKENS)

    def rem_full(self) -> int:
        a, c = self.allocator, self.cache
        pending = sum(self._decode_reserve(r) + r.remaining for r in self.running)
        return a.full_available_size() + c.full_evictable - pending

    def rem_swa(self) -> int:
        a, c, lim = self.allocator, self.cache, self.limits
        headroom = lim.swa_eviction_interval + lim.page_size
        pending = sum(headroom for r in self.running if r.output)
        return a.swa_available_size() + c.swa_evictable - pending

    @property
    def swa_budgeted(self) -> bool:
        return self.limits.window is not None and self.allocator.hybrid

    # ---- the step plan --------------------------------------------------------------------------
    def schedule(self) -> list[StepWork]:
        work = self._schedule_decodes()
        budget = self.limits.chunked_prefill_size
        for req in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            item = self._continue_chunk(req, budget)
            if item is not None:
                work.append(item)
                budget -= item.n
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_running_requests:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            work.append(item)
            budget -= item.n
        return work

    # ---- decode ---------------------------------------------------------------------------------
    def _schedule_decodes(self) -> list[StepWork]:
        decoding = [r for r in self.running if r.is_decoding]
        for req in decoding:
            self._free_out_of_window(req)
        if decoding and not self._alloc_decodes(decoding):
            # Out of room: first free every out-of-window SWA slot the interval left behind (a
            # pool smaller than W + interval + P per request would otherwise retract forever).
            for req in decoding:
                self._free_out_of_window(req, force=True)
            while decoding and not self._alloc_decodes(decoding):
                victim = decoding.pop()  # the most recently admitted decoding request
                self.retract(victim)
        return [StepWork(r, r.computed, 1, decode=True) for r in decoding]

    def _free_out_of_window(self, req: Req, force: bool = False) -> None:
        window, kv = self.limits.window, req.kv
        if not self.swa_budgeted or kv is None:
            return
        assert window is not None
        if kv.lock is not None and not kv.swa_lock_released:
            # The next query sits at kv_committed_len and reads keys from kv_committed_len - W
            # on: once that is >= cache_protected_len, the prefix's SWA is no longer read.
            if kv.kv_committed_len - kv.cache_protected_len >= window:
                kv.lock = self.cache.release_window_lock(kv.lock)
                kv.swa_lock_released = True
        # Per request (not per global step): free once `interval` tokens left the window.
        interval = 1 if force else self.limits.swa_eviction_interval
        if kv.kv_committed_len - window < kv.swa_evicted_seqlen + interval:
            return
        kv.swa_evicted_seqlen = free_out_of_window(
            self.allocator,
            kv.table,
            evicted=kv.swa_evicted_seqlen,
            protected=kv.cache_protected_len,
            pre_len=kv.kv_committed_len,
            window=window,
            page_size=self.limits.page_size,
            chunk_cache=not self.limits.radix,
            floor=kv.swa_evict_floor,
        )

    def _alloc_decodes(self, reqs: list[Req]) -> bool:
        P = self.limits.page_size
        new_pages = sum(1 for r in reqs if r.computed % P == 0)
        if not self._make_room(new_pages * P, new_pages * P):
            return False
        seq_lens = [r.computed + 1 for r in reqs]
        last = [int(r.kv.table[r.computed - 1]) for r in reqs]  # type: ignore[union-attr]
        out = self.allocator.alloc_decode(seq_lens, last)
        if out is None:
            return False
        for r, slot in zip(reqs, out.tolist()):
            kv = r.kv
            assert kv is not None
            kv.table[r.computed] = slot
            kv.kv_allocated_len = r.computed + 1
        return True

    def retract(self, req: Req) -> None:
        """Give back everything `req` holds and requeue it at the head (it re-prefills
        prompt + output; what it computed stays in the tree for reuse)."""
        self.running.remove(req)
        self.on_retract(req)
        req.kv, req.state = None, ReqState.WAITING
        req.retractions += 1
        self.retractions += 1
        self.waiting.appendleft(req)

    # ---- prefill --------------------------------------------------------------------------------
    def _continue_chunk(self, req: Req, budget: int) -> StepWork | None:
        if not self.limits.radix:
            self._free_before_chunk(req)
        n = min(req.remaining, budget)
        if self.swa_budgeted:
            # Keep one page for the allocation itself; no room at all -> defer (not stash).
            n = min(n, self.rem_swa() - self.limits.page_size)
        if n <= 0:
            return None
        return self._alloc_extend(req, n)

    def _free_before_chunk(self, req: Req) -> None:
        kv, window = req.kv, self.limits.window
        if kv is None or window is None or not self.allocator.hybrid:
            return
        kv.swa_evicted_seqlen = free_out_of_window(
            self.allocator, kv.table, evicted=kv.swa_evicted_seqlen, protected=0,
            pre_len=kv.kv_committed_len, window=window, page_size=self.limits.page_size,
            chunk_cache=True, floor=kv.swa_evict_floor,
        )  # fmt: skip

    def _admit(self, req: Req, budget: int) -> StepWork | None:
        tokens = req.all_tokens()
        match = self.cache.match_prefix(tokens[: len(tokens) - 1])
        receipt = self.cache.lock(match.node)
        kv = ReqKV(tokens=tokens, table=torch.zeros(req.max_len + self.limits.page_size, dtype=torch.int64))
        kv.table[: match.length] = match.indices
        kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = match.length
        kv.lock = receipt
        n = self._admissible_chunk(req, len(tokens) - match.length, budget)
        if n <= 0:
            self.cache.unlock(receipt)
            return None
        req.kv, req.state = kv, ReqState.RUNNING
        self.running.append(req)
        item = self._alloc_extend(req, n)
        if item is None:  # budgets said yes but pages are fragmented/short: undo, retry later
            self.running.remove(req)
            self.cache.cache_finished_req(kv, insert=False)
            req.kv, req.state = None, ReqState.WAITING
        elif req.cached_tokens < 0:
            req.cached_tokens = match.length
        return item

    def _admissible_chunk(self, req: Req, extend: int, budget: int) -> int:
        P = self.limits.page_size
        future = min(req.params.max_tokens - len(req.output), CLIP_MAX_NEW_TOKENS)
        # With nothing running the whole pool is this request's: validate() already refused
        # requests that can never fit, so the full budget only gates when others run.
        if self.running and not full_admits(extend, future, P, self.rem_full()):
            return 0
        n = min(extend, budget)
        if not self.swa_budgeted:
            return n
        window = self.limits.window
        assert window is not None
        rem_swa = self.rem_swa()
        if swa_admission_charge(extend, budget, window, P) < rem_swa:
            return n
        # Escape hatch (no head-of-line livelock): start with a chunk the SWA budget can hold.
        cap = chunk_cap(rem_swa, window, P)
        if cap <= 0 and not self.running:
            # NOTE: alone, nothing will ever free more (unlocked tree KV already counts as
            # evictable), and the matched prefix's SWA lock covers whole nodes: reserving W of
            # headroom on top would stall the queue forever. Take what the pool physically holds
            # (one page kept for the allocation, as for a continuing chunk).
            cap = rem_swa - P
        return min(n, cap) if cap > 0 else 0

    def _alloc_extend(self, req: Req, n: int) -> StepWork | None:
        kv = req.kv
        assert kv is not None
        P = self.limits.page_size
        start = kv.kv_committed_len
        # Exactly the fresh pages alloc_extend takes (the partial page at `start` is already
        # ours): an over-estimate here defers a chunk the pools can hold, forever when alone.
        need = ceil_page(start + n, P) - ceil_page(start, P)
        if not self._make_room(need, need):
            return None
        last = int(kv.table[start - 1]) if start > 0 else -1
        out = self.allocator.alloc_extend([start], [start + n], [last])
        if out is None:
            return None
        kv.table[start : start + n] = out
        kv.kv_allocated_len = start + n
        return StepWork(req, start, n)

    def _make_room(self, full_tokens: int, swa_tokens: int) -> bool:
        """Evict from the tree until both pools have this many free tokens (if they can)."""
        a = self.allocator
        full_short = max(0, full_tokens - a.full_available_size())
        swa_short = max(0, swa_tokens - a.swa_available_size()) if a.hybrid else 0
        if full_short or swa_short:
            freed = self.cache.evict(full_short, swa_short)
            self.evicted["full"] += freed.full
            self.evicted["swa"] += freed.swa
        ok_full = a.full_available_size() >= full_tokens
        return ok_full and (not a.hybrid or a.swa_available_size() >= swa_tokens)

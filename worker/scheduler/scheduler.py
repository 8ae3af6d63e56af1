"""`Scheduler`: the owner of every request's state, and the plan of each step.

Every state change of a request happens in this package, under this class's verbs: `add`
(waiting), admission (running, with KV), `commit` (the KV a forward wrote), `launched` / `landed`
(tokens in flight, overlap), `record_prompt_logprobs`, `append_token`, retraction (KV given back,
requeued), `finish` and `abort` (KV given back, finished). The cache's request hooks return
`KVUpdate`s that `worker.scheduler.kv_state` records. The engine only asks for a plan, runs it
and reports.

Policy (docs/design.md §11): mixed batches, decode first. Every decoding request feeds its one
token (out-of-window SWA freed per request every `swa_eviction_interval`; when the pools cannot
take the decode tokens even after evicting the tree and freeing everything out of the window,
the most recently admitted requests are retracted); then prefilling requests get their next
chunk and waiting requests are admitted FIFO while the step's prefill budget lasts, within both
pools' budgets (`worker.scheduler.budget`), through a tombstone repair or a load from the host
tier when the shared rule says so (`core.reuse`, docs/design.md §9.8, §9.9).
"""

from __future__ import annotations

from collections import deque

import torch

from core.geometry import ceil_page
from core.outputs import FinishReason, TokenLogprob
from core.reuse import Reuse, choose_reuse, plan_reuse
from worker.cache.base import MatchResult, PrefixCache
from worker.cache.req_kv import ReqKV
from worker.kv.hybrid_allocator import HybridAllocator
from worker.scheduler.budget import (
    StallGuard,
    continuing_chunk_len,
    first_chunk_len,
    full_admits,
    full_budget,
    future_tokens,
    repair_swa_charge,
    stall_error,
    swa_budget,
)
from worker.scheduler.kv_state import (
    PageRows,
    drop_row,
    free_before_chunk,
    free_decode_window,
    record,
)
from worker.scheduler.plan import SchedulerCounters, SchedulerLimits, StepWork
from worker.scheduler.request import Req, ReqState

# Decode tokens a running request is assumed to still need, at most (SGLang clips the same way):
# beyond this, retraction handles the rare request that really runs that long.
CLIP_MAX_NEW_TOKENS = 4096
# A waiting request whose prompt shares at least this many tokens (and a page) beyond what the
# tree holds with a request still prefilling them waits until that prefill is in the tree, then
# reuses it, instead of computing the same rows again beside it (SGLang's in-batch prefix check
# uses the same 32 tokens). Only while that prefill runs: a step or two.
SHARED_PREFILL_MIN = 32


class Scheduler:
    def __init__(self, limits: SchedulerLimits, allocator: HybridAllocator, cache: PrefixCache) -> None:
        self.limits = limits
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order
        self.reqs: dict[str, Req] = {}  # every unfinished request by id
        self.counters = SchedulerCounters()
        self._stall = StallGuard()
        self._rows = PageRows()  # the runner's device page-table rows (docs/design.md §18.1)

    # ---- life cycle -----------------------------------------------------------------------------
    def add(self, req: Req) -> bool:
        """Queue `req`; False, with `req` finished as refused, when its id is already running."""
        if req.rid in self.reqs:
            req.state, req.finish_reason = ReqState.FINISHED, "abort"
            req.error = f"duplicate request id {req.rid!r}"
            return False
        self.reqs[req.rid] = req
        self.waiting.append(req)
        return True

    def abort(self, request_id: str) -> Req | None:
        """Finish an unfinished request as aborted; None when there is no such request."""
        req = self.reqs.get(request_id)
        if req is None:
            return None
        self.finish(req, "abort")
        self.counters.aborts += 1
        return req

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """Give back everything `req` holds (the tree keeps its committed pages) and end it."""
        req.finish_reason, req.error = reason, error
        if req.state is ReqState.RUNNING:
            self.running.remove(req)
            self._release_kv(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = ReqState.FINISHED
        req.kv = None
        if req.cached_tokens < 0:
            req.cached_tokens = 0
        self.reqs.pop(req.rid, None)
        self.counters.cache_hit_tokens += req.cached_tokens
        self.counters.finished_prompt_tokens += len(req.prompt)

    def commit(self, work: list[StepWork]) -> None:
        """The forward wrote this step's KV: advance each request, and put every prefill chunk
        (the last one too) into the tree, so the prompt is tree-owned from now on — decode never
        frees its SWA and another request can reuse all of it (under SWA pressure the tree
        tombstones it instead)."""
        kvs = [w.req.kv for w in work]
        for w, kv in zip(work, kvs):
            assert kv is not None
            kv.kv_committed_len = w.start + w.n
            kv.synced_len = max(kv.synced_len, w.start + w.n)  # the forward wrote the row so far
        # Repairs whose rows are all computed first: their revived tails are in the tree before
        # any insert of this step (docs/design.md §9.8).
        for kv in kvs:
            if kv is not None and kv.repairing and kv.kv_committed_len >= kv.cache_protected_len:
                record(kv, self.cache.finish_repair(kv))
        for w, kv in zip(work, kvs):
            if not w.decode and self.limits.radix and kv is not None:
                record(kv, self.cache.cache_unfinished_req(kv))

    def launched(self, work: list[StepWork]) -> None:
        """The step's forward is submitted (overlap, docs/design.md §11.8): ending a request
        drops the KV of its decode in flight, and each sampler has a token in flight."""
        for w in work:
            if w.decode:
                w.req.rollback = w.start
            if w.samples:
                w.req.pending += 1

    def landed(self, w: StepWork) -> None:
        """The token `w` sampled is back (appended next, unless the request ended meanwhile)."""
        w.req.pending -= 1
        if w.req.rollback == w.start:
            w.req.rollback = -1  # no later decode of it in flight

    def record_prompt_logprobs(self, req: Req, logprobs: list[TokenLogprob]) -> None:
        """The prompt logprobs of the next positions (a chunk's logits rows gave them)."""
        assert req.prompt_logprobs is not None, f"request {req.rid} asked for no prompt logprobs"
        req.prompt_logprobs.extend(logprobs)

    def append_token(self, req: Req, token: int, logprob: TokenLogprob | None) -> None:
        req.output.append(token)
        if req.kv is not None:  # else retracted while the token was in flight: re-prefills it
            req.kv.tokens.append(token)
        if req.grammar is not None:
            req.grammar.accept(token)
        if logprob is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprob)

    def refuse_if_stalled(self, progressed: bool) -> Req | None:
        """Finish the newest request, with a clear error, when scheduling is stuck
        (`worker.scheduler.budget`). Returns the request refused."""
        victim = self._stall.victim(progressed, self.running, self.waiting)
        if victim is not None:
            self.finish(victim, "abort", error=stall_error(self.allocator, self.limits))
            self.counters.aborts += 1
        return victim

    def _retract(self, req: Req) -> None:
        """Give back everything `req` holds and requeue it at the head (it re-prefills
        prompt + output; what it computed stays in the tree for reuse)."""
        self.running.remove(req)
        self._release_kv(req)
        req.kv, req.state = None, ReqState.WAITING
        req.retractions += 1
        self.counters.retractions += 1
        self.waiting.appendleft(req)

    def _release_kv(self, req: Req) -> None:
        # The tree takes only committed (written) KV; the rest of the allocation is freed. A
        # decode still in flight (overlap) is dropped: its token is never used (§11.8).
        if req.kv is not None:
            if req.rollback >= 0:
                req.kv.kv_committed_len, req.rollback = req.rollback, -1
            record(req.kv, self.cache.cache_finished_req(req.kv, insert=self.limits.radix))
            drop_row(req.kv, self._rows)

    def check_rows(self) -> None:
        """Every running request holds its own page-table row (see `PageRows.check`)."""
        self._rows.check([r.kv.row for r in self.running if r.kv is not None])

    # ---- budgets --------------------------------------------------------------------------------
    def rem_full(self) -> int:
        return full_budget(self.allocator, self.cache, self.running, CLIP_MAX_NEW_TOKENS)

    def rem_swa(self) -> int:
        return swa_budget(self.allocator, self.cache, self.running, self.limits)

    @property
    def swa_budgeted(self) -> bool:
        return self.limits.geometry.window is not None and self.allocator.hybrid

    # ---- the step plan --------------------------------------------------------------------------
    def schedule(self) -> list[StepWork]:
        work = self._schedule_decodes()
        # The step's token budget: decodes first (never stalled by a prefill), prefill chunks
        # fill what is left, at most `chunked_prefill_size` of it (docs/design.md §11.7).
        budget = min(self.limits.chunked_prefill_size, self.limits.max_num_batched_tokens - len(work))
        prefilling = [r for r in self.running if not r.is_decoding]
        for req in prefilling:
            if budget <= 0:
                break
            item = self._continue_chunk(req, budget)
            if item is not None:
                work.append(item)
                budget -= item.n
        heads = None
        if self.limits.radix:
            heads = PrefillHeads(max(SHARED_PREFILL_MIN, self.limits.geometry.page_size), prefilling)
        while budget > 0 and len(self.running) < self.limits.max_running_requests:
            ready = self._next_waiting(heads)
            item = self._admit(ready, budget) if ready is not None else None
            if ready is None or item is None:
                break
            self.waiting.remove(ready)
            work.append(item)
            budget -= item.n
            if heads is not None:
                heads.add(ready)
        return work

    def _next_waiting(self, heads: PrefillHeads | None) -> Req | None:
        """The first waiting request that may start: a sibling of a multi-choice request waits
        until the first one's prompt is in the tree, then reuses it (one prefill for all), and
        so does a request whose prompt's head a running request is still prefilling (§11.1).
        `heads`: this step's prefills (None without the radix cache: plain FIFO)."""
        # NOTE: a first choice this scheduler does not know (finished, or not added yet because
        # its grammar compiled slower) holds nothing back: sharing is an optimisation only.
        if heads is None:
            return self.waiting[0] if self.waiting and not self.waiting[0].pending else None
        for req in self.waiting:
            if req.pending:  # retracted with a token in flight: it knows its tokens next step
                return None
            if req in heads.passed:
                continue
            first = self.reqs.get(req.follows) if req.follows else None
            if first is not None and first.computed < len(first.prompt):
                continue
            if heads.behind(req):
                heads.passed.add(req)  # for the rest of this step: more prefills only add heads
                continue
            return req
        return None

    # ---- decode ---------------------------------------------------------------------------------
    def _schedule_decodes(self) -> list[StepWork]:
        decoding = [r for r in self.running if r.is_decoding]
        self._free_windows(decoding)
        if decoding and not self._alloc_decodes(decoding):
            # Out of room: first free every out-of-window SWA slot the interval left behind (a
            # pool smaller than W + interval + P per request would otherwise retract forever).
            self._free_windows(decoding, force=True)
            while decoding and not self._alloc_decodes(decoding):
                self._retract(decoding.pop())  # the most recently admitted decoding request
        return [StepWork(r, r.computed, 1, decode=True) for r in decoding]

    def _free_windows(self, reqs: list[Req], force: bool = False) -> None:
        if not self.swa_budgeted:
            return
        for req in reqs:
            assert req.kv is not None
            free_decode_window(req.kv, self.allocator, self.cache, self.limits, force=force)

    def _alloc_decodes(self, reqs: list[Req]) -> bool:
        """One slot per decoding request, in one vectorised `alloc_decode` over the batch."""
        P = self.limits.geometry.page_size
        kvs = [r.kv for r in reqs]
        pos = [kv.kv_committed_len for kv in kvs]  # type: ignore[union-attr]
        new_pages = sum(1 for p in pos if p % P == 0)
        if not self._make_room(new_pages * P, new_pages * P):
            return False
        last = [int(kv.table[p - 1]) for kv, p in zip(kvs, pos)]  # type: ignore[union-attr]
        out = self.allocator.alloc_decode([p + 1 for p in pos], last)
        if out is None:
            return False
        for kv, p, slot in zip(kvs, pos, out.tolist()):
            assert kv is not None
            kv.table[p] = slot
            kv.kv_allocated_len = p + 1
        return True

    # ---- prefill --------------------------------------------------------------------------------
    def _continue_chunk(self, req: Req, budget: int) -> StepWork | None:
        assert req.kv is not None
        if not self.limits.radix:
            free_before_chunk(req.kv, self.allocator, self.limits)
        # An SWA budget keeps one page for the allocation itself; no room at all -> defer.
        rem_swa = self.rem_swa() if self.swa_budgeted else None
        n = continuing_chunk_len(budget, req.remaining, rem_swa, self.limits.geometry.page_size)
        return self._alloc_extend(req, n) if n > 0 else None

    def _admit(self, req: Req, budget: int) -> StepWork | None:
        tokens = req.all_tokens()
        match = self.cache.match_prefix(tokens[: req.reusable], req.params.root_hash)
        reuse = self._reuse(match)
        if reuse.repaired or reuse.loaded_full or reuse.loaded_swa:
            admit = self._admit_repair if reuse.repaired else self._admit_load
            admitted, item = admit(req, tokens, reuse, budget)
            if admitted:
                return item
            if reuse.loaded_full or reuse.loaded_swa:  # alone, no room: what the device holds
                match = self.cache.match_prefix(tokens[: req.reusable], req.params.root_hash)
        kv = self._new_kv(req, tokens, match)
        n = self._admissible_chunk(req, len(tokens) - match.length, budget)
        if n <= 0:
            assert kv.lock is not None
            self.cache.unlock(kv.lock)
            drop_row(kv, self._rows)
            return None
        item = self._start(req, kv, n)
        if item is not None and req.cached_tokens < 0:
            req.cached_tokens = match.length
        return item

    def _reuse(self, match: MatchResult) -> Reuse:
        """The shared rule (`core.reuse`): with a host tier, the cheapest of load / repair /
        recompute at this worker's prices; without one, `plan_reuse` exactly."""
        lim = self.limits
        repair = lim.tombstone_repair and lim.radix
        if match.tiered is None or lim.tier_costs is None:
            return plan_reuse(match.full_length, match.length, lim.geometry, repair=repair)
        return choose_reuse(match.tiered, lim.geometry, lim.tier_costs, repair=repair)

    def _admit_load(
        self, req: Req, tokens: list[int], reuse: Reuse, budget: int
    ) -> tuple[bool, StepWork | None]:
        """Admit through a load from the host tier (docs/design.md §9.9): the full KV of the
        used prefix and the SWA KV of the window before its end come back, then the forward
        starts at `reuse.reused`. (False, None): not now and nothing running (fall back)."""
        g = self.limits.geometry
        assert g.window is not None
        extend = len(tokens) - reuse.reused
        swa_from = reuse.reused - g.ceil(g.window)
        loaded = self._load(req, tokens, reuse.reused, swa_from, extend, budget)
        if loaded is None:
            return bool(self.running), None
        match, count = loaded
        kv = self._new_kv(req, tokens, match)
        n = self._admissible_chunk(req, extend, budget)
        item = self._start(req, kv, n) if n > 0 else None
        if item is None:  # (the checks said yes: the loaded KV stays the tree's either way)
            if n <= 0:
                record(kv, self.cache.cache_finished_req(kv, insert=False))
                drop_row(kv, self._rows)
            return True, None
        if req.cached_tokens < 0:
            req.cached_tokens, req.loaded_tokens = reuse.reused, count
        return True, item

    def _load(
        self, req: Req, tokens: list[int], length: int, swa_from: int | None, extend: int, budget: int
    ) -> tuple[MatchResult, int] | None:
        """Load the host-resident part of `tokens[:length]` (SWA from `swa_from` on) when the
        admission's budgets hold with the loaded tokens counted and the pools make room;
        returns the device match and the tokens loaded, or None (nothing changed)."""
        g = self.limits.geometry
        plan = self.cache.prepare_load(tokens[: req.reusable], length, swa_from, req.params.root_hash)
        future = future_tokens(req, CLIP_MAX_NEW_TOKENS)
        fits = not self.running or full_admits(extend + plan.full_tokens, future, g.page_size, self.rem_full())
        if fits and self.swa_budgeted and swa_from is not None:
            alone = not self.running
            fits = first_chunk_len(extend, budget, self.rem_swa() - plan.swa_tokens, g, alone=alone) > 0
        if not (fits and self._make_room(plan.full_tokens, plan.swa_tokens)):
            self.cache.cancel_load(plan)
            return None
        self.counters.loads += 1
        return self.cache.load(plan), plan.full_tokens + plan.swa_tokens  # counted apart (Reuse's)

    def _admit_repair(
        self, req: Req, tokens: list[int], reuse: Reuse, budget: int
    ) -> tuple[bool, StepWork | None]:
        """Admit through a repair (docs/design.md §9.8): lock the full match, take scratch pairs
        for the repair rows, start the forward at `reuse.reused`. (False, None): not now and
        nothing running, so fall back to the valid match (alone, nothing will free more). A
        full match partly on the host tier is loaded first (full KV only)."""
        g, rows = self.limits.geometry, reuse.repaired
        loaded = 0
        if reuse.loaded_full:
            got = self._load(req, tokens, reuse.reused + rows, None, len(tokens) - reuse.reused, budget)
            if got is None:
                return bool(self.running), None
            loaded = got[1]
        kv = self._new_kv(req, tokens, self.cache.match_full(tokens[: req.reusable], req.params.root_hash))
        assert kv.cache_protected_len == reuse.reused + rows, "the full match moved"
        extend = len(tokens) - reuse.reused  # the scratch rows + the new slots after p_full
        n = min(extend, budget)
        fits = (
            not self.running or full_admits(extend, future_tokens(req, CLIP_MAX_NEW_TOKENS), g.page_size, self.rem_full())
        ) and repair_swa_charge(n, rows, g) < self.rem_swa()
        scratch = self.allocator.alloc(rows) if fits and self._make_room(rows, rows) else None
        if scratch is None:
            record(kv, self.cache.cache_finished_req(kv, insert=False))
            drop_row(kv, self._rows)
            return bool(self.running), None
        kv.kv_committed_len, kv.repair_start, kv.repair_slots = reuse.reused, reuse.reused, scratch
        item = self._start(req, kv, n)
        if item is not None:
            self.counters.repairs += 1
            self.counters.repaired_tokens += rows
            if req.cached_tokens < 0:
                req.cached_tokens, req.repaired_tokens, req.loaded_tokens = reuse.reused, rows, loaded
        return True, item

    def _new_kv(self, req: Req, tokens: list[int], match: MatchResult) -> ReqKV:
        """A fresh ReqKV (every admission: a retracted request restarts clean) on a locked match."""
        table = torch.zeros(req.max_len + self.limits.geometry.page_size, dtype=torch.int64)
        table[: match.length] = match.indices
        lock, row, m = self.cache.lock(match.node), self._rows.take(), match.length
        return ReqKV(
            tokens=tokens, root_hash=req.params.root_hash, table=table, cache_protected_len=m,
            kv_committed_len=m, kv_allocated_len=m, lock=lock, row=row,
        )  # fmt: skip

    def _start(self, req: Req, kv: ReqKV, n: int) -> StepWork | None:
        req.kv, req.state = kv, ReqState.RUNNING
        self.running.append(req)
        item = self._alloc_extend(req, n)
        if item is None:  # budgets said yes but pages are fragmented/short: undo, retry later
            self.running.remove(req)
            record(kv, self.cache.cache_finished_req(kv, insert=False))
            drop_row(kv, self._rows)
            req.kv, req.state = None, ReqState.WAITING
        return item

    def _admissible_chunk(self, req: Req, extend: int, budget: int) -> int:
        g = self.limits.geometry
        # With nothing running the whole pool is this request's: validate() already refused
        # requests that can never fit, so the full budget only gates when others run.
        if self.running and not full_admits(extend, future_tokens(req, CLIP_MAX_NEW_TOKENS), g.page_size, self.rem_full()):
            return 0
        if not self.swa_budgeted:
            return min(extend, budget)
        return first_chunk_len(extend, budget, self.rem_swa(), g, alone=not self.running)

    def _alloc_extend(self, req: Req, n: int) -> StepWork | None:
        kv = req.kv
        assert kv is not None
        P = self.limits.geometry.page_size
        start = kv.kv_committed_len
        # Repair rows already have their slots (the tree's, and scratch pairs): allocate past them.
        lo = max(start, kv.cache_protected_len) if kv.repairing else start
        end = start + n
        # Exactly the fresh pages alloc_extend takes (the partial page at `lo` is already ours):
        # an over-estimate here defers a chunk the pools can hold, forever when alone.
        need = ceil_page(end, P) - ceil_page(lo, P) if end > lo else 0
        if not self._make_room(need, need):
            return None
        if end > lo:
            last = int(kv.table[lo - 1]) if lo > 0 else -1
            out = self.allocator.alloc_extend([lo], [end], [last])
            if out is None:
                return None
            kv.table[lo:end] = out
        kv.kv_allocated_len = max(kv.kv_allocated_len, end)
        return StepWork(req, start, n)

    def _make_room(self, full_tokens: int, swa_tokens: int) -> bool:
        """Evict from the tree until both pools have this many free tokens (if they can)."""
        a = self.allocator
        full_short = max(0, full_tokens - a.full_available_size())
        swa_short = max(0, swa_tokens - a.swa_available_size()) if a.hybrid else 0
        if full_short or swa_short:
            freed = self.cache.evict(full_short, swa_short)
            self.counters.full_evicted_tokens += freed.full
            self.counters.swa_evicted_tokens += freed.swa
        ok_full = a.full_available_size() >= full_tokens
        return ok_full and (not a.hybrid or a.swa_available_size() >= swa_tokens)


class PrefillHeads:
    """One step's prefills in progress, by (cache salt's root, first `least` prompt tokens):
    what a waiting request would compute again beside them (docs/design.md §11.1). A waiting
    request costs one dict lookup; only a request with the same head is compared further."""

    __slots__ = ("least", "_by_head", "passed")

    def __init__(self, least: int, prefilling: list[Req]) -> None:
        self.least = least
        self._by_head: dict[tuple[int, tuple[int, ...]], list[Req]] = {}
        self.passed: set[Req] = set()  # waiting requests passed over this step
        for r in prefilling:
            self.add(r)

    def add(self, r: Req) -> None:
        """`r` prefills this step (its `computed` is where the step's chunk starts)."""
        if len(r.prompt) - r.computed >= self.least:
            self._by_head.setdefault((r.params.root_hash, tuple(r.prompt[: self.least])), []).append(r)

    def behind(self, req: Req) -> bool:
        """`req` shares at least `least` tokens with the part of a prefilling request's prompt
        that request has yet to compute (under the same salt)."""
        if not self._by_head or len(req.prompt) < self.least:
            return False
        least = self.least
        for r in self._by_head.get((req.params.root_hash, tuple(req.prompt[:least])), ()):
            limit = min(req.reusable, len(req.prompt), len(r.prompt))
            if limit - r.computed >= least and shared_len(req.prompt, r.prompt, limit) - r.computed >= least:
                return True
        return False


def shared_len(a: list[int], b: list[int], limit: int, step: int = 64) -> int:
    """Length of the common head of `a` and `b` (both at least `limit` long), at most `limit`:
    `step` tokens at a time (list slices compare in C), then token by token in the first block
    that differs."""
    n = 0
    while n < limit:
        end = min(n + step, limit)
        if a[n:end] != b[n:end]:
            while n < end and a[n] == b[n]:
                n += 1
            return n
        n = end
    return limit

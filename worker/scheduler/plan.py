"""What the scheduler works with and hands out: its limits, one step's work, its counters."""

from __future__ import annotations

from dataclasses import dataclass

from core.geometry import Geometry
from core.reuse import TierCosts
from worker.runner.forward_batch import ForwardReq, PromptRows, RepairRows
from worker.scheduler.request import Req


@dataclass(frozen=True)
class SchedulerLimits:
    # Page size, window (None: no SWA pool to budget, single pool or no SWA layer) and the SWA
    # layer count (the repair rule's n_swa), as the cache sees them.
    geometry: Geometry
    chunked_prefill_size: int  # most prompt tokens one step prefills
    max_running_requests: int
    swa_eviction_interval: int
    radix: bool  # False: chunk cache (frees SWA before each chunk with the exact window)
    tombstone_repair: bool = False  # repair tombstoned prefixes (docs/design.md §9.8)
    max_num_batched_tokens: int = 1 << 62  # tokens per step, decodes included (§11.7)
    tier_costs: TierCosts | None = None  # a host tier's prices (docs/design.md §9.9); None: none


@dataclass(frozen=True)
class StepWork:
    """One scheduled request: feed `tokens[start:start+n]` (its slots are allocated)."""

    req: Req
    start: int
    n: int
    decode: bool = False  # a decoding request's one token (else a prefill chunk)

    @property
    def reaches_end(self) -> bool:
        """The chunk ends at the last token."""
        return self.start + self.n == self.req.num_tokens

    @property
    def samples(self) -> bool:
        """The step samples the request's next token (not for a prompt-only request)."""
        return self.reaches_end and self.req.params.max_tokens > 0

    def forward_req(self) -> ForwardReq:
        kv = self.req.kv
        assert kv is not None, f"request {self.req.rid} was scheduled without KV"
        tokens = kv.tokens[self.start : self.start + self.n]
        repair = None
        if kv.repair_slots is not None:
            repair = RepairRows(kv.repair_start, kv.repair_slots)
        row = kv.row if kv.row >= 0 else None
        return ForwardReq(
            tokens, self.start, kv.table, self.samples, prompt_logprobs=self.prompt_rows(),
            repair=repair, row=row, synced=min(kv.synced_len, self.start),
        )  # fmt: skip

    def prompt_rows(self) -> PromptRows | None:
        """The prompt logprobs this step's tokens give that the request still lacks."""
        req, top_n = self.req, self.req.params.prompt_logprobs
        positions = req.prompt_rows(self.start, self.n)
        if not positions or top_n is None:
            return None
        next_ids = tuple(req.prompt[positions.start + 1 : positions.stop + 1])
        return PromptRows(positions.start - self.start, next_ids, top_n)


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counts kept by the scheduler (step thread only; stats snapshots copy them)."""

    retractions: int = 0
    aborts: int = 0
    full_evicted_tokens: int = 0  # tokens the tree gave up to make room, per pool
    swa_evicted_tokens: int = 0
    finished_prompt_tokens: int = 0  # prompt tokens of finished requests
    cache_hit_tokens: int = 0  # of those, served from the prefix cache at first admission
    repairs: int = 0  # admissions through a tombstone repair (docs/design.md §9.8)
    repaired_tokens: int = 0  # repair rows those admissions recomputed
    loads: int = 0  # admissions that loaded KV from the host tier (docs/design.md §9.9)

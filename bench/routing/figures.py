"""Figures of one simulated run (`RunFigures`), computed from a `SimOutcome`.

| figure | definition |
|---|---|
| hit rate | Σ cached tokens / Σ prompt tokens (cached = what the engine reused at admission) |
| prefill tokens | tokens the runners computed as prefill (fed tokens − decode feeds; includes re-prefill after a retraction and repair rows) |
| repaired tokens | of those, repair rows: recomputed only to rebuild a tombstoned prefix's SWA KV (docs/design.md §9.8) |
| loaded tokens | KV tokens admissions loaded back from the host tier, full and SWA apart (docs/design.md §9.9); part of cached |
| offloaded tokens | tokens any of whose KV device eviction moved to the host tier |
| TTFT | first token's step end − arrival, virtual seconds |
| throughput | generated tokens / (last finish − first arrival), virtual seconds |
| prediction | the policy's predicted cached tokens for the worker it chose vs the engine's actual: exact / over (credited a prefix the worker did not reuse) / under; loaded: its predicted loaded tokens equal the engine's |
| quiet decisions | decisions made while the chosen worker was idle: its index entry equalled its cache, so a correct prediction must be exact |
| decision latency | wall-clock µs of `RouterCore.decide` on this machine |
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.routing.sim import SimOutcome


@dataclass(frozen=True)
class RunFigures:
    workload: str
    pool: str
    policy: str
    workers: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int
    generated_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    makespan_s: float
    throughput_tok_s: float
    predictions_exact: int
    predictions_over: int
    predictions_under: int
    prediction_abs_error_tokens: int  # Σ |predicted − actual|
    quiet_decisions: int
    quiet_exact: int
    decision_us_p50: float
    decision_us_p99: float
    tombstone_pages: int
    retractions: int
    swa_evicted_tokens: int
    full_evicted_tokens: int
    max_requests_per_worker: int
    sim_wall_s: float
    repaired_tokens: int = 0
    repairs: int = 0
    loads: int = 0  # admissions that loaded KV from the host tier
    loaded_full_tokens: int = 0
    loaded_swa_tokens: int = 0
    offloaded_tokens: int = 0
    loaded_predictions_exact: int = 0

    @property
    def loaded_tokens(self) -> int:
        return self.loaded_full_tokens + self.loaded_swa_tokens


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]) of a non-empty sequence."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def _done(t: float | None) -> float:
    assert t is not None, "a simulated request never reached this point"
    return t


def summarize(outcome: SimOutcome, workload: str, pool: str) -> RunFigures:
    tracks = outcome.tracks
    prompt = sum(len(t.req.tokens) for t in tracks)
    cached = sum(t.cached for t in tracks)
    generated = sum(len(t.output) for t in tracks)
    ttft = [_done(t.first_token_s) - t.req.arrival_s for t in tracks]
    span = max(_done(t.finish_s) for t in tracks) - min(t.req.arrival_s for t in tracks)
    errors = [t.predicted - t.cached for t in tracks]
    quiet = [t for t in tracks if t.quiet]
    decisions = [t.decision_us for t in tracks]
    per_worker = Counter(t.worker for t in tracks)
    return RunFigures(
        workload=workload,
        pool=pool,
        policy=outcome.policy,
        workers=outcome.cluster.workers,
        requests=len(tracks),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        prefill_tokens=outcome.prefill_tokens,
        generated_tokens=generated,
        ttft_p50_s=quantile(ttft, 0.50),
        ttft_p99_s=quantile(ttft, 0.99),
        ttft_mean_s=sum(ttft) / len(ttft),
        makespan_s=span,
        throughput_tok_s=generated / span if span > 0 else 0.0,
        predictions_exact=sum(e == 0 for e in errors),
        predictions_over=sum(e > 0 for e in errors),
        predictions_under=sum(e < 0 for e in errors),
        prediction_abs_error_tokens=sum(abs(e) for e in errors),
        quiet_decisions=len(quiet),
        quiet_exact=sum(t.predicted == t.cached for t in quiet),
        decision_us_p50=quantile(decisions, 0.50),
        decision_us_p99=quantile(decisions, 0.99),
        tombstone_pages=outcome.tombstone_pages,
        retractions=outcome.retractions,
        swa_evicted_tokens=outcome.swa_evicted_tokens,
        full_evicted_tokens=outcome.full_evicted_tokens,
        max_requests_per_worker=max(per_worker.values()),
        sim_wall_s=outcome.wall_s,
        repaired_tokens=outcome.repaired_tokens,
        repairs=outcome.repairs,
        loads=outcome.loads,
        loaded_full_tokens=outcome.loaded_full_tokens,
        loaded_swa_tokens=outcome.loaded_swa_tokens,
        offloaded_tokens=outcome.offloaded_tokens,
        loaded_predictions_exact=sum(t.predicted_loaded == t.loaded for t in tracks),
    )

"""What the engine hands back: per-request outputs, stream deltas and stats (docs/design.md §4.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

# The kinds of `error` (`Output.error`, `StreamDelta.error`) written for the request's client,
# as "<kind>: <what happened>": the engine's per-request endings (a grammar that failed or
# allows no token, no finite logit left to sample). The ingress shows these to the client and
# keeps any other error text (an exception's, a dying engine's) for its log alone.
CLIENT_ERROR_KINDS = ("structured output", "sampling")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the top-n alternatives


@dataclass(frozen=True)
class Output:
    """A finished request (offline `generate`)."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    finish_reason: FinishReason
    cached_tokens: int  # prompt tokens whose forward was skipped (served from the prefix cache)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set when the request was refused (finish_reason "abort")
    # One per prompt token when asked for (SamplingParams.prompt_logprobs); the first is None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    repaired_tokens: int = 0  # tokens recomputed to repair a tombstoned prefix (design.md §9.8)
    # KV tokens of the prompt loaded from the host tier, full and SWA counted apart
    # (`core.reuse.Reuse.loaded_full + loaded_swa`; design.md §9.9); part of `cached_tokens`.
    loaded_tokens: int = 0


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request since its previous delta (async streaming)."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_len: int
    cached_tokens: int
    completion_tokens: int  # total so far
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # Sent once, in the first delta after the prompt is computed (see Output.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    repaired_tokens: int = 0  # of the prompt after `cached_tokens`, recomputed as a repair
    loaded_tokens: int = 0  # KV tokens loaded from the host tier (see Output.loaded_tokens)


@dataclass(frozen=True)
class PoolStats:
    total: int  # allocatable tokens
    free: int
    evictable: int  # held only by the radix cache
    used: int  # total - free - evictable (held by requests)
    peak_used: int


@dataclass(frozen=True)
class TierStats:
    """One pool of the host KV tier (docs/design.md §9.9): tokens it holds, tokens in use."""

    total: int = 0
    used: int = 0


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of an engine, published by its step thread (worker/engine/stats.py).

    Counters (`cache_hit_tokens` … `steps`) are monotonic since start; `prompt_tokens` and
    `cache_hit_tokens` count finished requests.
    """

    full: PoolStats
    swa: PoolStats  # the full pool again when there is one pool (`hybrid` False)
    hybrid: bool
    waiting: int
    running: int
    queued_prefill_tokens: int  # prompt tokens still to compute (waiting + prefilling)
    running_decodes: int  # running requests in their decode phase
    cache_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    full_evicted_tokens: int
    swa_evicted_tokens: int
    tombstone_tokens: int
    retractions: int
    aborts: int
    steps: int
    last_step_seconds: float
    repairs: int = 0  # admissions through a tombstone repair
    repaired_tokens: int = 0  # tokens those repairs recomputed
    # The host tier (docs/design.md §9.9); all zero without one.
    host_full: TierStats = TierStats()
    host_swa: TierStats = TierStats()
    loaded_tokens: int = 0  # tokens any of whose KV came back from the host tier
    loaded_full_tokens: int = 0  # of those, full KV loaded (every full layer)
    loaded_swa_tokens: int = 0  # SWA KV loaded (every SWA layer)
    loaded_bytes: int = 0
    offloaded_tokens: int = 0  # tokens any of whose KV moved to the host tier
    offloaded_bytes: int = 0

"""Pool sizing: how many token slots the full pool and the SWA pool get (docs/design.md §6.1).

Notation: F = bytes one token takes over all full layers, S = over all SWA layers
(`ModelSpec.kind_bytes_per_token`), r = `swa_full_tokens_ratio`, P = page size, B = KV budget.

| case                                   | full_tokens                     | swa_tokens               |
|----------------------------------------|---------------------------------|--------------------------|
| hybrid (ratio split)                   | floor_P(B // (F + r*S))         | floor_P(int(r * full))   |
| hybrid, radix off + ChunkCap           | floor_P((B - swa*S) // F)       | ceil_P(worst case)       |
| all-SWA (r ignored)                    | 0                               | floor_P(B // S)          |
| no SWA layers / disable_hybrid_swa     | floor_P(B // (F + S)): one pool | = full_tokens            |

`max_total_tokens` caps the full pool (the SWA pool for all-SWA models) before the split; with
a byte budget too, the smaller wins. A hybrid SWA pool must hold more than `window + page_size`
tokens (the prefill admission floor, docs/design.md §11.3), else nothing is admitted: fail fast.

Beside the pools, the plan sizes the prompt-logprob workspace: 1/32 of the pools' bytes, which
says how many prompt rows the runner turns into logprobs at once (`plan_logprob_rows`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from core.geometry import ceil_page, floor_page
from worker.errors import ConfigError
from worker.kv.frontier import steady_swa_per_request
from worker.models.spec import LayerKind, ModelSpec

logger = logging.getLogger(__name__)
_GIB = 1024**3


@dataclass(frozen=True)
class ChunkCap:
    """Radix off + chunked prefill + a request cap: worst-case SWA pool (docs/design.md §6.1)."""

    max_running_requests: int
    chunked_prefill_size: int
    swa_eviction_interval: int = 128
    overlap: bool = False  # overlap scheduling keeps two chunks in flight

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.chunked_prefill_size < 1:
            raise ConfigError(
                f"ChunkCap needs max_running_requests >= 1 and chunked_prefill_size >= 1, got "
                f"{self.max_running_requests} and {self.chunked_prefill_size}"
            )

    def swa_tokens(self, window: int, page_size: int) -> int:
        """ceil_P(per_req * requests + chunks_in_flight * chunk + P), per_req = W + interval + 2P."""
        decode_alloc = page_size  # one page per decode step, no speculation
        per_req = (
            steady_swa_per_request(window, self.swa_eviction_interval, page_size) + decode_alloc
        )
        chunks = 2 if self.overlap else 1
        cap = per_req * self.max_running_requests + chunks * self.chunked_prefill_size + page_size
        return ceil_page(cap, page_size)


@dataclass(frozen=True)
class PoolPlan:
    """Token slots and bytes per pool. `hybrid`: SWA layers live in their own pool."""

    full_tokens: int
    swa_tokens: int
    hybrid: bool
    page_size: int
    full_bytes: int  # bytes of all full layers' KV buffers
    swa_bytes: int  # bytes of all SWA layers' KV buffers (in the shared pool when not hybrid)

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    @property
    def max_total_tokens(self) -> int:
        """Tokens the pool that bounds context holds: the full pool, or SWA for all-SWA models."""
        return self.full_tokens if self.full_tokens else self.swa_tokens

    def describe(self) -> str:
        return (
            f"full_layer_tokens={self.full_tokens} swa_layer_tokens={self.swa_tokens} "
            f"hybrid={self.hybrid} page_size={self.page_size} full_bytes={self.full_bytes} "
            f"swa_bytes={self.swa_bytes} total={self.total_bytes / _GIB:.2f} GiB"
        )


def plan_pools(
    spec: ModelSpec,
    *,
    page_size: int,
    dtype_bytes: int,
    swa_full_tokens_ratio: float = 0.8,
    kv_cache_bytes: int | None = None,
    max_total_tokens: int | None = None,
    disable_hybrid_swa_memory: bool = False,
    chunk_cap: ChunkCap | None = None,
) -> PoolPlan:
    """Size both pools from a byte budget and/or a token cap; raises ConfigError saying what to change."""
    _validate(page_size, dtype_bytes, swa_full_tokens_ratio, kv_cache_bytes, max_total_tokens)
    sizing = _Sizing(spec, page_size, dtype_bytes, kv_cache_bytes, max_total_tokens)
    if not spec.has_swa or disable_hybrid_swa_memory:
        plan = sizing.single_pool()
    elif spec.is_all_swa:
        plan = sizing.all_swa()
    elif chunk_cap is not None:
        plan = sizing.chunk_capped(chunk_cap)
    else:
        plan = sizing.ratio_split(swa_full_tokens_ratio)
    if plan.hybrid:
        _check_swa_floor(plan, spec.window or 0, swa_full_tokens_ratio)
    logger.info("KV pools: %s", plan.describe())
    return plan


# ---------------------------------------------------------------- sizing per case


@dataclass(frozen=True)
class _Sizing:
    spec: ModelSpec
    page_size: int
    dtype_bytes: int
    budget: int | None
    cap: int | None

    @property
    def f(self) -> int:
        return self.spec.kind_bytes_per_token(LayerKind.FULL, self.dtype_bytes)

    @property
    def s(self) -> int:
        return self.spec.kind_bytes_per_token(LayerKind.SWA, self.dtype_bytes)

    def tokens(self, cell: float) -> int:
        """floor_P(min(B // cell, cap)): the slots a pool with `cell` bytes per slot gets."""
        limits = [self.cap] if self.cap is not None else []
        if self.budget is not None:
            limits.append(int(self.budget // cell))
        n = floor_page(min(limits), self.page_size)
        if n <= 0:
            raise ConfigError(
                f"the KV budget holds no page: {self.budget} bytes / {cell:.0f} bytes per token, "
                f"max_total_tokens={self.cap}, page_size={self.page_size}; raise kv_cache_bytes "
                f"(one page needs {math.ceil(cell * self.page_size)} bytes) or max_total_tokens"
            )
        return n

    def plan(self, full: int, swa: int, hybrid: bool) -> PoolPlan:
        swa_slots = swa if hybrid else full
        return PoolPlan(full, swa, hybrid, self.page_size, full * self.f, swa_slots * self.s)

    def single_pool(self) -> PoolPlan:
        n = self.tokens(self.f + self.s)  # every layer keeps every token
        return self.plan(n, n, hybrid=False)

    def all_swa(self) -> PoolPlan:
        return self.plan(0, self.tokens(self.s), hybrid=True)

    def ratio_split(self, ratio: float) -> PoolPlan:
        full = self.tokens(self.f + ratio * self.s)
        return self.plan(full, floor_page(int(full * ratio), self.page_size), hybrid=True)

    def chunk_capped(self, chunk_cap: ChunkCap) -> PoolPlan:
        swa = chunk_cap.swa_tokens(self.spec.window or 0, self.page_size)
        if self.cap is not None:
            swa = min(swa, self.cap)
        limits = [floor_page(self.cap, self.page_size)] if self.cap is not None else []
        if self.budget is not None:
            limits.append(floor_page((self.budget - swa * self.s) // self.f, self.page_size))
        full = min(limits)
        if full <= 0:
            raise ConfigError(
                f"the chunk-capped SWA pool ({swa} tokens, {swa * self.s} bytes) leaves no full-pool "
                f"page in {self.budget} bytes: raise kv_cache_bytes or lower max_running_requests "
                f"({chunk_cap.max_running_requests}) / chunked_prefill_size ({chunk_cap.chunked_prefill_size})"
            )
        return self.plan(full, swa, hybrid=True)


# ---------------------------------------------------------------- checks


def _validate(
    page_size: int, dtype_bytes: int, ratio: float, budget: int | None, cap: int | None
) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(
            f"swa_full_tokens_ratio must be in (0, 1], got {ratio}; the default is 0.8"
        )
    if page_size < 1 or page_size & (page_size - 1):
        raise ConfigError(
            f"page_size must be a power of two (1, 2, 4, ... 16 ...), got {page_size}"
        )
    if dtype_bytes < 1:
        raise ConfigError(f"dtype_bytes must be >= 1, got {dtype_bytes}")
    if budget is None and cap is None:
        raise ConfigError(
            "give a KV budget: kv_cache_bytes (bytes) or max_total_tokens (full-pool tokens)"
        )
    for name, value in (("kv_cache_bytes", budget), ("max_total_tokens", cap)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")


def _check_swa_floor(plan: PoolPlan, window: int, ratio: float) -> None:
    floor = window + plan.page_size
    if plan.swa_tokens <= floor:
        raise ConfigError(
            f"the SWA pool holds {plan.swa_tokens} tokens but must hold more than window + page_size "
            f"= {window} + {plan.page_size} = {floor} (the prefill admission floor); raise "
            f"kv_cache_bytes or max_total_tokens, or swa_full_tokens_ratio (now {ratio})"
        )


# ---------------------------------------------------------------- the host tier (§9.9)


@dataclass(frozen=True)
class HostPlan:
    """Token slots and bytes of the host tier, one pool per device pool (docs/design.md §9.9).
    `full_tokens` of an all-SWA model are addresses without buffers (as on the device)."""

    full_tokens: int
    swa_tokens: int
    page_size: int
    full_bytes: int
    swa_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    def describe(self) -> str:
        return (
            f"host full_tokens={self.full_tokens} swa_tokens={self.swa_tokens} "
            f"total={self.total_bytes / _GIB:.2f} GiB"
        )


def plan_host_pools(
    spec: ModelSpec, device: PoolPlan, *, dtype_bytes: int, host_kv_bytes: int, ratio: float
) -> HostPlan:
    """Split `host_kv_bytes` between a host full pool and a host SWA pool as the device split
    is made (`ratio` = SWA tokens / full tokens). Needs separate SWA pools on the device (the
    tier moves each pool's KV on its own); raises ConfigError when it holds no page."""
    if not device.hybrid:
        raise ConfigError(
            "host_kv_bytes needs separate full and SWA pools (a model with sliding-window layers, "
            "disable_hybrid_swa_memory: false); set host_kv_bytes: 0"
        )
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"host_swa_full_tokens_ratio must be in (0, 1], got {ratio}")
    sizing = _Sizing(spec, device.page_size, dtype_bytes, host_kv_bytes, None)
    if spec.is_all_swa:
        swa = sizing.tokens(sizing.s)
        full = swa * HOST_ALL_SWA_VIRTUAL_FULL
    else:
        full = sizing.tokens(sizing.f + ratio * sizing.s)
        swa = floor_page(int(full * ratio), device.page_size)
        if swa <= 0:
            raise ConfigError(
                f"the host tier's SWA pool holds no page ({full} full tokens x ratio {ratio}); "
                "raise host_kv_bytes or host_swa_full_tokens_ratio"
            )
    plan = HostPlan(full, swa, device.page_size, full * sizing.f, swa * sizing.s)
    logger.info("KV host tier: %s", plan.describe())
    return plan


# All-SWA models: host full slots are plain addresses (no full layer), several per SWA slot so
# host tombstones have room, as on the device (worker/assembly/pools.py).
HOST_ALL_SWA_VIRTUAL_FULL = 4


# ---------------------------------------------------------------- prompt-logprob workspace

# Prompt logprobs need a distribution over the whole vocabulary per prompt row; the runner makes
# them a bounded number of rows at a time (docs/design.md §6.1). The workspace is a fixed share
# of the KV pools' bytes: on CUDA's default budget the pools and the workspace split it
# (`kv_share_of`); a budget the config fixes is the pools', the workspace comes on top.
LOGPROB_SHARE = 32  # the workspace is 1/32 of the KV pools' bytes
# Bytes one row takes per vocabulary entry at its peak: four float32 copies at most (the head's
# output and, eagerly, a final softcap's temporaries; then its float32 cast and the log_softmax).
LOGPROB_ROW_BYTES = 4 * 4


@dataclass(frozen=True)
class LogprobPlan:
    """How many prompt rows the runner turns into logprobs at once, and what they take."""

    rows: int
    bytes: int  # rows x vocab x LOGPROB_ROW_BYTES


def plan_logprob_rows(kv_bytes: int, vocab_size: int) -> LogprobPlan:
    """The rows of `kv_bytes` // LOGPROB_SHARE bytes (one at least, whatever the vocabulary)."""
    per_row = vocab_size * LOGPROB_ROW_BYTES
    rows = max(1, kv_bytes // LOGPROB_SHARE // per_row)
    return LogprobPlan(rows, rows * per_row)


def kv_share_of(budget: int) -> int:
    """The KV pools' part of a budget they share with the prompt-logprob workspace."""
    return budget * LOGPROB_SHARE // (LOGPROB_SHARE + 1)

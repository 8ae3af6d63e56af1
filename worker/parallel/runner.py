"""`TPRunner`: the engine's runner when the model is split over N ranks (docs/design.md §17.3).

    rank 0 (the engine's step thread)                 ranks 1..N-1 (`serve_rank`)
    host = ModelRunner._prepare(batch)                 (wait on the control group)
    broadcast Step(host, q_lens, seq_lens) ─────────▶  msg
    execute(host) on shard 0 ◀─── all-reduces ───▶     execute(msg.host) on shard r
    gather logits slices ◀──────────────────────────   send logits slice
    sample (rank 0 only)

Every rank keeps its own device page table (docs/design.md §18.1): the host inputs carry the
entries new this step and each rank writes them into its table before its forward.
Rank 0's allocator translated the SWA slots once; since one allocator hands out every slot and
every rank's pools hold the same number of tokens (only head counts differ), the same slot
indices are valid in every rank's pools. Ranks 1..N-1 have no allocator, scheduler or cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.models.spec import LayerKind, ModelSpec
from worker.parallel.group import TPGroup
from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.model_runner import Gather, ModelRunner, _HostInputs
from worker.runner.sampler import SampleOutput, SampleRow

if TYPE_CHECKING:
    from worker.kv.hybrid_allocator import HybridAllocator
    from worker.kv.pool import HybridKVPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One forward: what `ModelRunner._prepare` built on rank 0, and the batch's lengths."""

    host: _HostInputs
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


@dataclass(frozen=True)
class CheckPools:
    """Every rank reports its pools (`PoolReport`) to rank 0."""


@dataclass(frozen=True)
class Stop:
    """Leave the loop; the group is closed next."""


Message = Step | CheckPools | Stop


@dataclass(frozen=True)
class PoolReport:
    rank: int
    rows: dict[LayerKind, int]  # buffer rows of the pool each kind lives in (tokens + page 0)
    kv_heads: dict[LayerKind, int]
    digests: dict[LayerKind, float]  # sum of every K and V element of the kind's layers (float64)


def run_step(runner: ModelRunner, group: TPGroup, step: Step, vocab: int) -> ForwardOutput | None:
    """Every rank: this shard's forward; rank 0 gets the outputs over the whole vocabulary (each
    piece of logits the runner makes is gathered, on every rank alike)."""

    def whole(local: torch.Tensor) -> torch.Tensor | None:
        logits = group.gather_last_dim(local)
        return None if logits is None else logits[:, :vocab]  # drop the vocab padding

    return runner.execute(step.host, step.q_lens, step.seq_lens, Gather(whole, group.is_first))


DIGEST_CHUNK_ELEMS = 1 << 22  # float64 temporaries of a pool check: 32 MiB at most


def kv_digest(buf: torch.Tensor) -> float:
    """The sum of `buf`'s elements in float64, a few rows at a time.

    NOTE: `buf.double().sum()` made a float64 copy of a whole KV buffer (4x a bf16 pool, on
    the device), enough to fail the check on a full GPU; here the copies are one chunk of
    rows. Every rank sums the same way, so replicated heads give equal digests."""
    flat = buf.reshape(buf.shape[0], -1)
    rows = max(1, DIGEST_CHUNK_ELEMS // max(1, flat.shape[1]))
    total = 0.0
    for part in flat.split(rows):
        total += float(part.double().sum())
    return total


def pool_report(pool: HybridKVPool, spec: ModelSpec, rank: int) -> PoolReport:
    rows, heads, digests = {}, {}, {}
    for kind in LayerKind:
        layers = spec.full_layer_ids if kind is LayerKind.FULL else spec.swa_layer_ids
        if not layers:
            continue
        bufs = [b for lid in layers for b in pool.kv_buffers(lid)]
        rows[kind], heads[kind] = bufs[0].shape[0], bufs[0].shape[1]
        digests[kind] = sum(kv_digest(b) for b in bufs)
    return PoolReport(rank, rows, heads, digests)


def serve_rank(runner: ModelRunner, group: TPGroup, vocab: int) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until `Stop` (or until a collective fails)."""
    while True:
        msg: Message = group.broadcast()
        if isinstance(msg, Stop):
            return
        if isinstance(msg, CheckPools):
            group.gather(pool_report(runner.pool, runner.spec, group.rank))
        else:
            run_step(runner, group, msg, vocab)


class TPRunner:
    """Rank 0's `Runner`: prepares once, ships the host inputs, runs shard 0, samples."""

    def __init__(
        self, inner: ModelRunner, group: TPGroup, vocab: int, full_spec: ModelSpec
    ) -> None:
        self.inner, self.group, self.vocab = inner, group, vocab
        self.full_spec = full_spec  # KV heads before the split: which kinds are replicated
        self._closed = False

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        step = Step(
            self.inner._prepare(batch),
            tuple(len(r.token_ids) for r in batch.reqs),
            tuple(r.seq_len for r in batch.reqs),
        )
        self.group.broadcast(step)
        out = run_step(self.inner, self.group, step, self.vocab)
        assert out is not None, "rank 0 receives the gathered logits"
        if self.inner.check_tables:
            self.inner.verify_table(batch)  # rank 0's page table (the others apply the same)
        return out

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        return self.inner.sample(logits, rows, bitmask)  # rank 0 samples the gathered logits

    # ---- the other ranks -------------------------------------------------------------------------
    def check_pools(self) -> None:
        """Every rank's pools hold the allocator's tokens with this rank's share of heads, and
        ranks that hold the same replicated KV head hold the same K and V."""
        self.group.broadcast(CheckPools())
        reports = self.group.gather(pool_report(self.inner.pool, self.inner.spec, 0))
        assert reports is not None
        assert self.inner.allocator is not None, "rank 0 owns the allocator"
        check_reports(
            reports, self.inner.allocator, self.inner.pool, self.inner.spec, self.full_spec
        )

    def stop(self) -> bool:
        """Tell the other ranks to leave their loop (idempotent). False: the group is broken."""
        if self._closed:
            return True
        self._closed = True
        try:
            self.group.broadcast(Stop())
            return True
        except Exception:  # noqa: BLE001 - a rank is already gone; the caller ends the rest
            logger.warning("tensor-parallel stop message failed", exc_info=True)
            return False

    def close(self) -> None:
        """Leave the group (after `stop` and after the other ranks exited)."""
        self.group.close()


def check_reports(
    reports: list[PoolReport], allocator: HybridAllocator, pool: HybridKVPool, spec: ModelSpec,
    full_spec: ModelSpec,
) -> None:  # fmt: skip
    """Raise AssertionError naming the first rank whose pools break the TP invariants."""
    P = pool.page_size
    for r in reports:
        for kind, rows in r.rows.items():
            in_swa_pool = pool.hybrid and kind is LayerKind.SWA
            tokens = allocator.swa_size if in_swa_pool else allocator.full_size
            if rows != tokens + P:
                raise AssertionError(
                    f"rank {r.rank}: the {kind.value} layers' pool has {rows} rows, the allocator "
                    f"indexes {tokens} tokens + page 0 (one allocator serves every rank's pools)"
                )
            if r.kv_heads[kind] != spec.shape(kind).num_kv_heads:
                raise AssertionError(
                    f"rank {r.rank}: {kind.value} pools hold {r.kv_heads[kind]} KV heads, the "
                    f"shard has {spec.shape(kind).num_kv_heads}"
                )
    size = len(reports)
    for kind in reports[0].digests:
        total = full_spec.shape(kind).num_kv_heads
        if total >= size:
            continue
        g = size // total  # replicated: ranks r and r' share a head iff r // g == r' // g
        for r in reports:
            twin = reports[(r.rank // g) * g]
            if r.digests[kind] != twin.digests[kind]:
                raise AssertionError(
                    f"{kind.value} KV head replicated on ranks {twin.rank} and {r.rank} differs "
                    f"between them (K+V sums {twin.digests[kind]} vs {r.digests[kind]})"
                )

"""`ModelRunner`: turns a `ForwardBatch` into logits, and logits into tokens.

Per step it builds, on the host and once: the input ids and positions, the new tokens' FULL slots
(`out_loc`) and SWA slots (`swa_out_loc`), and one key view per layer kind (FULL slots as given;
SWA slots for the window only, translated through the allocator in ONE call). Everything is
copied to the model device once, the backend plans once, then the model runs. A repair's rows
write to and read SWA keys from its scratch slots, FULL keys from the cached ones (§9.8).

The two halves are separate methods: `_prepare` (host, needs the allocator) and `execute`
(device). Under tensor parallelism rank 0 prepares once and every rank executes the same host
inputs on its own shard and pools (`worker/parallel/runner.py`, docs/design.md §17.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from worker.attention.base import AttentionBackend, AttnBatch, KVView
from worker.models.spec import LayerKind, ModelSpec
from worker.runner.forward_batch import ForwardBatch, ForwardContext, ForwardReq
from worker.runner.sampler import SampleOutput, Sampler, SampleRow

if TYPE_CHECKING:
    from worker.kv.hybrid_allocator import HybridAllocator
    from worker.kv.pool import HybridKVPool
    from worker.models.causal_lm import CausalLM


@dataclass(frozen=True)
class _HostInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    swa_out_loc: torch.Tensor | None
    views: dict[LayerKind, KVView]
    logit_rows: torch.Tensor


@dataclass(frozen=True)
class PreparedStep:
    """One step's host inputs, built ahead of its forward (overlap scheduling)."""

    host: _HostInputs
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


def _offsets(lengths: Sequence[int]) -> list[int]:
    """Exclusive prefix sums with the total appended: ``[0, l0, l0 + l1, ...]`` (host ints)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _spread(shifts: Sequence[int], lengths: Sequence[int], total: int) -> torch.Tensor:
    """``arange(total)`` plus ``shifts[i]`` on segment i (of ``lengths[i]`` entries): the one
    vectorised form of "for each request, a run of consecutive indices"."""
    if all(n == 1 for n in lengths):  # all decodes: one index per request
        return torch.tensor(shifts, dtype=torch.int64) + torch.arange(total)
    shift = torch.repeat_interleave(
        torch.tensor(shifts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    return torch.arange(total) + shift


class ModelRunner:
    """Runs one model over a hybrid KV pool with one attention backend."""

    def __init__(
        self,
        spec: ModelSpec,
        model: CausalLM,
        pool: HybridKVPool,
        allocator: HybridAllocator | None,  # None: a rank that only executes (never prepares)
        backend: AttentionBackend,
        *,
        device: str | torch.device = "cpu",
        sampler: Sampler | None = None,
        check_slots: bool = True,
    ) -> None:
        self.spec = spec
        self.model = model
        self.pool = pool
        self.allocator = allocator
        self.backend = backend
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()
        # Cheap on the host: catches an engine bug (reading a freed slot) before it corrupts output.
        self.check_slots = check_slots
        _check_model_matches_spec(model, spec)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[batch.num_logits, vocab]`` in batch order."""
        host = self._prepare(batch)
        return self.execute(
            host, tuple(len(r.token_ids) for r in batch.reqs), tuple(r.seq_len for r in batch.reqs)
        )

    def prepare(self, batch: ForwardBatch) -> PreparedStep:
        """The host half of `forward`, on the scheduling thread (it reads the allocator). Token
        ids < 0 are future tokens, resolved by `run_prepared` (docs/design.md §11.8)."""
        lens = tuple(len(r.token_ids) for r in batch.reqs), tuple(r.seq_len for r in batch.reqs)
        return PreparedStep(self._prepare(batch), *lens)

    def run_prepared(self, step: PreparedStep, future: torch.Tensor | None = None) -> torch.Tensor:
        """The device half of `forward`, on the forward thread: an input id ``-1 - i`` is
        ``future[i]``, a token the step before sampled."""
        ids = step.host.input_ids
        if future is not None and bool((ids < 0).any()):
            ids.copy_(torch.where(ids < 0, future[(-1 - ids).clamp(min=0)], ids))
        return self.execute(step.host, step.q_lens, step.seq_lens)

    @torch.inference_mode()
    def execute(
        self, host: _HostInputs, q_lens: tuple[int, ...], seq_lens: tuple[int, ...]
    ) -> torch.Tensor:
        """The device half of a step: float32 logits ``[rows, vocab of this model]``."""
        dev = self.device
        views = {
            kind: KVView(v.indices.to(dev), v.indptr.to(dev), v.kv_starts)
            for kind, v in host.views.items()
        }
        positions = host.positions.to(dev)
        attn = AttnBatch(
            q_lens=q_lens,
            seq_lens=seq_lens,
            positions=positions,
            kv=views,
            window=self.spec.window,
        )
        swa_out = host.swa_out_loc.to(dev) if host.swa_out_loc is not None else None
        ctx = ForwardContext(
            self.pool, self.backend, self.backend.plan(attn), host.out_loc.to(dev), swa_out
        )
        hidden = self.model(host.input_ids.to(dev), positions, ctx)
        if host.logit_rows.numel() == 0:
            return hidden.new_empty(0, self.spec.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[host.logit_rows.to(dev)]).float()

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """Pick one token per logits row (see `Sampler.sample`)."""
        return self.sampler.sample(logits, rows, bitmask)

    # ---- host-side preparation -------------------------------------------------------------------
    def _prepare(self, batch: ForwardBatch) -> _HostInputs:
        """Host tensors of one step, built with a fixed number of tensor ops (one table slice
        per request; everything else is vectorised over the batch)."""
        reqs = batch.reqs
        for r in reqs:
            r.validate()
        q_lens = [len(r.token_ids) for r in reqs]
        prefix = [r.prefix_len for r in reqs]
        seq = [p + q for p, q in zip(prefix, q_lens)]
        q_off = _offsets(q_lens)
        total = q_off[-1]
        ids = torch.tensor(list(chain.from_iterable(r.token_ids for r in reqs)), dtype=torch.int64)
        positions = _spread([p - o for p, o in zip(prefix, q_off)], q_lens, total)
        # Every key slot a layer may read: table[start:seq] per request, start = 0 when the model
        # has full layers (else the SWA window start). The SWA view and both out_locs are
        # sub-ranges of this one concatenation.
        window = self.spec.window or 0
        # NOTE: a repair has no SWA keys before its start (docs/design.md §9.8).
        swa_starts = [max(0 if r.repair is None else r.repair.start, p - window) for r, p in zip(reqs, prefix)]
        has_full = bool(self.spec.full_layer_ids)
        starts = [0] * len(reqs) if has_full else swa_starts
        slots = torch.cat([r.table[s:n] for r, s, n in zip(reqs, starts, seq)]).to(torch.int64)
        ptr = _offsets([n - s for n, s in zip(seq, starts)])
        # What the new tokens write and the SWA layers read: the same, except repair rows.
        wslots = _with_repair_slots(slots, reqs, starts, seq, ptr)
        out_loc = wslots[
            _spread([e - q - o for e, q, o in zip(ptr[1:], q_lens, q_off)], q_lens, total)
        ]
        views: dict[LayerKind, KVView] = {}
        swa_out_loc = None
        if has_full:
            views[LayerKind.FULL] = KVView(slots, torch.tensor(ptr), (0,) * len(reqs))
        if self.spec.swa_layer_ids:
            views[LayerKind.SWA], swa_out_loc = self._swa_view(
                wslots, ptr, starts, swa_starts, seq, q_lens
            )
        if self.check_slots:
            _check_slots(views, out_loc, swa_out_loc)
        rows = [
            row
            for i, r in enumerate(reqs)
            for row in range(q_off[i + 1] - r.logit_rows, q_off[i + 1])
        ]
        return _HostInputs(
            ids, positions, out_loc, swa_out_loc, views, torch.tensor(rows, dtype=torch.int64)
        )

    def _swa_view(
        self,
        slots: torch.Tensor,
        ptr: list[int],
        starts: list[int],
        swa_starts: list[int],
        seq: list[int],
        q_lens: list[int],
    ) -> tuple[KVView, torch.Tensor]:
        """The SWA range of each request, cut out of `slots` and translated in ONE call."""
        lens = [n - s for n, s in zip(seq, swa_starts)]
        swa_ptr = _offsets(lens)
        shifts = [p + (w - s) - o for p, w, s, o in zip(ptr, swa_starts, starts, swa_ptr)]
        full_idx = slots[_spread(shifts, lens, swa_ptr[-1])]
        assert self.allocator is not None, "only the rank that owns the allocator prepares"
        swa_idx = self.allocator.translate(full_idx)  # the one translation
        # The new tokens are the tail of each request's SWA range: slice their slots out of it.
        q_off = _offsets(q_lens)
        tails = [e - q - o for e, q, o in zip(swa_ptr[1:], q_lens, q_off)]
        swa_out_loc = swa_idx[_spread(tails, q_lens, q_off[-1])]
        return KVView(swa_idx, torch.tensor(swa_ptr), tuple(swa_starts)), swa_out_loc


def _with_repair_slots(
    slots: torch.Tensor,
    reqs: Sequence[ForwardReq],
    starts: list[int],
    seq: list[int],
    ptr: list[int],
) -> torch.Tensor:
    """`slots` with each repair's positions pointing at its scratch slots (a copy; `slots`
    itself when no request repairs). Full layers still read `slots` (the cached KV)."""
    if all(r.repair is None for r in reqs):
        return slots
    out = slots.clone()
    for i, r in enumerate(reqs):
        rep = r.repair
        if rep is None:
            continue
        lo, hi = max(starts[i], rep.start), min(seq[i], rep.end)
        if hi > lo:
            out[ptr[i] + lo - starts[i] : ptr[i] + hi - starts[i]] = rep.slots[lo - rep.start : hi - rep.start]
    return out


def _check_slots(
    views: dict[LayerKind, KVView], out_loc: torch.Tensor, swa_out_loc: torch.Tensor | None
) -> None:
    """Slot 0 is the dummy page and -1 means "unmapped": neither may be read or written."""
    for kind, view in views.items():
        if view.indices.numel() and int(view.indices.min()) <= 0:
            raise RuntimeError(
                f"a {kind.value} key slot in the batch is freed or unmapped (slot <= 0): the engine "
                "freed KV that a query still needs (SWA: the window before prefix_len must be live)"
            )
    if int(out_loc.min()) <= 0 or (swa_out_loc is not None and int(swa_out_loc.min()) <= 0):
        raise RuntimeError("a new token has no slot (<= 0): allocate before calling forward")


def _check_model_matches_spec(model: CausalLM, spec: ModelSpec) -> None:
    """The pool is sized from the spec, the kernels from the model: they must agree."""
    for layer in model.attention_layers():
        kind, _ = spec.layer_index[layer.layer_id]
        shape = spec.shape(kind)
        in_model = (
            layer.kind,
            layer.num_q_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.v_head_dim,
        )
        in_spec = (kind, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim)
        if in_model != in_spec:
            raise ValueError(
                f"layer {layer.layer_id}: the model has (kind, q heads, kv heads, head dim, v head "
                f"dim) = {in_model}, the spec says {in_spec}; build both from "
                "the same HF config"
            )

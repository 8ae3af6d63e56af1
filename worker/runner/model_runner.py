"""`ModelRunner`: turns a `ForwardBatch` into logits, and logits into tokens.

Per step it builds, on the host and once, everything as int64 parts of ONE packed host tensor:
the input ids and positions, the new tokens' FULL slots (`out_loc`) and SWA slots
(`swa_out_loc`), the page-table entries new this step, and the SWA key view (window-bounded,
translated through the allocator in ONE call). The FULL keys never cross: they sit in the
runner's persistent device page table (one row per running request, `DeviceTable`,
docs/design.md §18.1), which each step only extends by the entries the host has and the
device does not (a decode: one per request). So host work per step is O(batch + window), not
O(tokens). The packed tensor is copied to the model device once (from a pinned staging buffer,
non-blocking, on CUDA), the backend plans once, then the model runs — or, for a decode batch
with CUDA graphs on, a captured graph replays (`worker/runner/cuda_graphs.py`, §18.2). A
repair's rows write to and read SWA keys from its scratch slots, FULL keys from the cached
ones (§9.8).

The two halves are separate methods: `_prepare` (host, needs the allocator) and `execute`
(device). Under tensor parallelism rank 0 prepares once and every rank executes the same host
inputs on its own shard, pools and page table (`worker/parallel/runner.py`, §17.3).

Logits are made for the sampling rows (one per request that samples) and, for prompt logprobs,
for a request's prompt rows `logprob_rows` at a time: each piece is turned into `TokenLogprob`s
before the next is made, so a chunk of thousands of prompt rows never holds ``[chunk x vocab]``
logits (the memory plan's workspace bounds a piece: docs/design.md §6.1). A piece never mixes
requests, and a failure turning one into logprobs is that request's alone
(`ForwardOutput.prompt_errors`); the head itself failing fails the step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from core.outputs import TokenLogprob
from worker.attention.base import AttentionBackend, AttnBatch, KVView
from worker.models.context import ForwardContext
from worker.models.spec import LayerKind, ModelSpec
from worker.runner.forward_batch import ForwardBatch, ForwardOutput, ForwardReq
from worker.runner.sampler import SampleOutput, Sampler, SampleRow, token_logprobs

if TYPE_CHECKING:
    from worker.kv.hybrid_allocator import HybridAllocator
    from worker.kv.pool import HybridKVPool
    from worker.models.causal_lm import CausalLM
    from worker.runner.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

# Debug aid tests turn on (tests/conftest.py): after every step compare each request's device
# page-table row with its host table, and check every FULL key slot (O(tokens) per step).
CHECK_TABLES_ENV = "SWASERVE_CHECK_TABLES"

_PARTS = (
    "ids", "pos", "out", "swa_out", "rows", "sync_row", "sync_col", "sync_val",
    "full_row", "full_len", "full_idx", "full_ptr", "swa_idx", "swa_ptr",
)  # fmt: skip


WARM_UP_SIZES = (1, 3)  # decode of one request (specialised by dynamo) and any other count
# Prompt rows turned into logprobs at once when no memory plan says (runners built by hand).
DEFAULT_LOGPROB_ROWS = 128
PROMPT_LOGPROBS_FAILED = "prompt logprobs could not be computed for this request"


@dataclass(frozen=True)
class Gather:
    """Tensor parallelism: how this rank's logits (its vocabulary shard) become the whole
    vocabulary's (`worker/parallel/runner.py`)."""

    whole: Callable[[torch.Tensor], torch.Tensor | None]  # a collective; None off rank 0
    samples: bool  # this rank gets the whole logits (rank 0)


@dataclass(frozen=True)
class _PromptPiece:
    """At most `logprob_rows` prompt rows of one request: hidden rows ``[row, row + n)`` give
    the logprobs of `next_ids` (n of them)."""

    index: int  # the request's place in the batch
    row: int
    next_ids: tuple[int, ...]
    top_n: int


@dataclass(frozen=True)
class _HostInputs:
    """One step's host inputs: every integer tensor as a part of ONE packed int64 tensor (one
    copy to the device), plus the host ints backends plan with. Pickled to the other ranks
    under tensor parallelism (a fresh tensor of O(batch + window) entries, never a view)."""

    packed: torch.Tensor  # int64 CPU
    spans: dict[str, tuple[int, int]]  # part -> (offset, length) inside `packed`
    full_rows: tuple[int, ...] | None  # paged FULL view: each request's table row; None: flat
    full_lens: tuple[int, ...]  # FULL keys per request (seq_len), () without full layers
    swa_starts: tuple[int, ...] | None  # SWA view's first position per request (None: no SWA)
    swa_lens: tuple[int, ...]
    table_width: int  # positions the page table must hold (the batch's longest sequence)
    prompt: tuple[_PromptPiece, ...] = ()  # prompt-logprob rows, in pieces

    @property
    def num_logit_rows(self) -> int:
        return self.spans["rows"][1]

    def part(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        off, n = self.spans[name]
        return packed.narrow(0, off, n)

    @property
    def logit_rows(self) -> torch.Tensor:
        return self.part(self.packed, "rows")


def _pack(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    spans, off, order = {}, 0, []
    for name in _PARTS:
        t = parts.get(name)
        n = 0 if t is None else t.numel()
        spans[name] = (off, n)
        off += n
        if t is not None and n:
            order.append(t)  # every part is built 1-D int64
    packed = torch.cat(order) if order else torch.empty(0, dtype=torch.int64)
    return packed, spans


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


class DeviceTable:
    """The persistent page table on the model device (SGLang's ``req_to_token``): int32
    ``[rows, width]``, row r = the FULL slots by position of the request the scheduler gave
    row r. Entries are written only when new (`write`); it grows (a copy) if a row or a
    position beyond its size shows up, which a table sized from the config never sees."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros(max(rows, 1), max(width, 1), dtype=torch.int32, device=device)

    def ensure(self, rows: int, width: int) -> None:
        r, w = self.table.shape
        if rows <= r and width <= w:
            return
        grown = torch.zeros(max(rows, 2 * r if rows > r else r), max(width, 2 * w if width > w else w),
                            dtype=torch.int32, device=self.device)  # fmt: skip
        grown[:r, :w] = self.table
        self.table = grown

    def write(self, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor) -> None:
        if rows.numel():
            self.table[rows, cols] = vals.to(torch.int32)


class _Stager:
    """Pinned host staging for the packed inputs on CUDA: two buffers used in turn, each
    reused only after the copy that last read it finished (a CUDA event), so the copy to the
    device can be non-blocking. On CPU the packed tensor is used as it is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._bufs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def to_device(self, packed: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return packed.to(self.device)
        i, n = self._turn, packed.numel()
        self._turn ^= 1
        event = self._events[i]
        if event is not None:
            event.synchronize()
        while len(self._bufs) < 2:
            self._bufs.append(torch.empty(0, dtype=torch.int64).pin_memory())
        if self._bufs[i].numel() < n:
            self._bufs[i] = torch.empty(max(n, 2 * self._bufs[i].numel()), dtype=torch.int64).pin_memory()
        staged = self._bufs[i][:n]
        staged.copy_(packed)
        out = staged.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))  # this device's, from any thread
        self._events[i] = ev
        return out


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
        table_rows: int = 1,  # page-table rows (max_running_requests); grows if exceeded
        table_width: int = 1,  # positions per row (max_model_len + page); grows if exceeded
        graphs: DecodeGraphs | None = None,
        logprob_rows: int = DEFAULT_LOGPROB_ROWS,  # prompt rows per piece (the memory plan's)
    ) -> None:
        if logprob_rows < 1:
            raise ValueError(f"logprob_rows must be >= 1, got {logprob_rows}")
        self.spec = spec
        self.model = model
        self.pool = pool
        self.allocator = allocator
        self.backend = backend
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()
        # Cheap on the host (O(batch + window)): catches an engine bug (reading a freed slot)
        # before it corrupts output. The O(tokens) checks run only with CHECK_TABLES_ENV set.
        self.check_slots = check_slots
        self.check_tables = os.environ.get(CHECK_TABLES_ENV, "") not in ("", "0")
        self.table = DeviceTable(table_rows, table_width, self.device)
        self._stager = _Stager(self.device)
        self.graphs = graphs
        self.logprob_rows = logprob_rows
        _check_model_matches_spec(model, spec)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step: the sampling rows' float32 logits ``[batch.num_logits, vocab]`` in batch
        order, and the prompt logprobs asked for (forward_batch.py)."""
        host = self._prepare(batch)
        out = self.execute(
            host, tuple(len(r.token_ids) for r in batch.reqs), tuple(r.seq_len for r in batch.reqs)
        )
        assert out is not None, "one rank: its own logits"
        if self.check_tables:
            self.verify_table(batch)
        return out

    def verify_table(self, batch: ForwardBatch) -> None:
        """Debug check (O(tokens)): every row of the batch equals its host table up to seq_len,
        and no FULL key slot is freed."""
        for r in batch.reqs:
            host = r.table[: r.seq_len]
            if r.seq_len and int(host.min()) <= 0:
                raise RuntimeError(
                    "a FULL key slot of a request is freed or unmapped (slot <= 0): the engine "
                    "freed KV that a query still needs"
                )
            if r.row is None:
                continue
            dev = self.table.table[r.row, : r.seq_len].to("cpu", torch.int64)
            if not torch.equal(dev, host.to(torch.int64)):
                bad = int((dev != host).nonzero()[0])
                raise AssertionError(
                    f"page-table row {r.row} differs from the request's table at position {bad} "
                    f"({int(dev[bad])} vs {int(host[bad])}): a table write below `synced` was "
                    "not reported (ForwardReq.synced)"
                )

    def prepare(self, batch: ForwardBatch) -> PreparedStep:
        """The host half of `forward`, on the scheduling thread (it reads the allocator). Token
        ids < 0 are future tokens, resolved by `run_prepared` (docs/design.md §11.8)."""
        lens = tuple(len(r.token_ids) for r in batch.reqs), tuple(r.seq_len for r in batch.reqs)
        return PreparedStep(self._prepare(batch), *lens)

    def run_prepared(self, step: PreparedStep, future: torch.Tensor | None = None) -> ForwardOutput:
        """The device half of `forward`, on the forward thread: an input id ``-1 - i`` is
        ``future[i]``, a token the step before sampled."""
        ids = step.host.part(step.host.packed, "ids")  # a view: the fix lands in the packed copy
        if future is not None and bool((ids < 0).any()):
            ids.copy_(torch.where(ids < 0, future[(-1 - ids).clamp(min=0)], ids))
        out = self.execute(step.host, step.q_lens, step.seq_lens)
        assert out is not None, "one rank: its own logits"
        return out

    @torch.inference_mode()
    def execute(
        self,
        host: _HostInputs,
        q_lens: tuple[int, ...],
        seq_lens: tuple[int, ...],
        gather: Gather | None = None,
    ) -> ForwardOutput | None:
        """The device half of a step. `gather` (tensor parallelism) turns this rank's logits
        into the whole vocabulary's, on rank 0; a rank it gives None returns None."""
        hidden, rows = self._hidden(host, q_lens, seq_lens)
        return self._outputs(hidden, rows, host, gather)

    def _hidden(
        self, host: _HostInputs, q_lens: tuple[int, ...], seq_lens: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the host inputs over, plan, run the model: hidden states ``[tokens, hidden]``
        and the sampling rows (int64, on the device)."""
        dev = self.device
        packed = self._stager.to_device(host.packed)

        def part(name: str) -> torch.Tensor:
            return host.part(packed, name)

        views: dict[LayerKind, KVView] = {}
        if host.full_rows is not None:
            self.table.ensure(max(host.full_rows) + 1, host.table_width)
            self.table.write(part("sync_row"), part("sync_col"), part("sync_val"))
            if self.spec.full_layer_ids:
                n = len(host.full_rows)
                views[LayerKind.FULL] = KVView.paged(
                    self.table.table, host.full_rows, part("full_row"), (0,) * n,
                    host.full_lens, torch.zeros(n, dtype=torch.int64, device=dev), part("full_len"),
                )  # fmt: skip
        elif self.spec.full_layer_ids:
            views[LayerKind.FULL] = KVView(
                part("full_idx"), part("full_ptr"), (0,) * len(q_lens), host.full_lens
            )
        if host.swa_starts is not None:
            views[LayerKind.SWA] = KVView(
                part("swa_idx"), part("swa_ptr"), host.swa_starts, host.swa_lens
            )
        positions = part("pos")
        attn = AttnBatch(
            q_lens=q_lens, seq_lens=seq_lens, positions=positions, kv=views, window=self.spec.window
        )
        swa_out = part("swa_out") if self.spec.swa_layer_ids else None
        if self.graphs is not None and self.graphs.can_run(q_lens):
            return self.graphs.run(attn, part("ids"), part("out"), swa_out), part("rows")
        ctx = ForwardContext(self.pool, self.backend, self.backend.plan(attn), part("out"), swa_out)
        return self.model(part("ids"), positions, ctx), part("rows")

    def _outputs(
        self, hidden: torch.Tensor, rows: torch.Tensor, host: _HostInputs, gather: Gather | None
    ) -> ForwardOutput | None:
        logits = self._head(hidden[rows], gather)
        out = None if logits is None else ForwardOutput(logits)
        for piece in host.prompt:
            wanted = out is not None and piece.index not in out.prompt_errors
            got = self._prompt_piece(hidden, piece, gather, wanted)  # every rank: head, gather
            if out is None or got is None:
                continue  # not the sampling rank, or the request already failed
            if isinstance(got, str):
                out.prompt_logprobs.pop(piece.index, None)
                out.prompt_errors[piece.index] = got
            else:
                out.prompt_logprobs.setdefault(piece.index, []).extend(got)
        return out

    def _prompt_piece(
        self, hidden: torch.Tensor, piece: _PromptPiece, gather: Gather | None, wanted: bool
    ) -> list[TokenLogprob] | str | None:
        """One piece's logprobs (`wanted`: on the sampling rank, for a request that has not
        failed; else None), or why they failed (that request's alone). NOTE: its logits die
        with this call, before the next piece's are made."""
        logits = self._head(hidden[piece.row : piece.row + len(piece.next_ids)], gather)
        if logits is None or not wanted:
            return None
        try:
            return token_logprobs(logits, piece.next_ids, piece.top_n)
        except Exception:  # noqa: BLE001 - that request ends alone (forward_batch.py)
            logger.exception("prompt logprobs of batch row %d failed", piece.index)
            return PROMPT_LOGPROBS_FAILED

    def _head(self, hidden: torch.Tensor, gather: Gather | None) -> torch.Tensor | None:
        """float32 logits of these hidden rows over the whole vocabulary (None: not this rank's).
        NOTE: with no row the head and the gather are skipped on every rank alike."""
        if hidden.shape[0] == 0:
            empty = hidden.new_empty(0, self.spec.vocab_size, dtype=torch.float32)
            return empty if gather is None or gather.samples else None
        local = self.model.compute_logits(hidden).float()
        return local if gather is None else gather.whole(local)

    @torch.inference_mode()
    def warm_up(self, sizes: Sequence[int] = WARM_UP_SIZES) -> None:
        """Run the model once per token count in `sizes` against the reserved slot 0, so a
        compiled model compiles here (before any graph capture and before the replica reports
        healthy), not in a request. Flat key views: the page table is not touched.

        NOTE: slot 0 is the dummy page (`PageAllocator` never hands it out and `_check_slots`
        refuses to read it), so writing the warm-up tokens' K/V there disturbs nothing.
        """
        dev = self.device
        for n in sizes:
            # NOTE: made like a step's inputs (views of one int64 tensor, not inference tensors),
            # so warm-up compiles the variants steps use and no step compiles again.
            with torch.inference_mode(False):
                packed = torch.zeros(2 * n, dtype=torch.int64, device=dev)
                zeros, positions = packed[:n], packed[n:]
                positions.copy_(torch.arange(n, device=dev))
            view = KVView(zeros, torch.tensor([0, n], device=dev), (0,), (n,))
            kinds = [k for k, ids in ((LayerKind.FULL, self.spec.full_layer_ids),
                                      (LayerKind.SWA, self.spec.swa_layer_ids)) if ids]  # fmt: skip
            attn = AttnBatch(q_lens=(n,), seq_lens=(n,), positions=positions,
                             kv=dict.fromkeys(kinds, view), window=self.spec.window)  # fmt: skip
            swa_out = zeros if self.spec.swa_layer_ids else None
            ctx = ForwardContext(self.pool, self.backend, self.backend.plan(attn), zeros, swa_out)
            hidden = self.model(zeros, positions, ctx)
            self.model.compute_logits(hidden)
        if self.model.compiled is not None:
            self.model.compiled.warmed = True  # every variant compiled: guards cut (§19)

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """Pick one token per logits row (see `Sampler.sample`)."""
        return self.sampler.sample(logits, rows, bitmask)

    # ---- host-side preparation -------------------------------------------------------------------
    def _prepare(self, batch: ForwardBatch) -> _HostInputs:
        assert self.allocator is not None, "only the rank that owns the allocator prepares"
        return prepare_inputs(
            batch, self.spec, self.allocator, check_slots=self.check_slots,
            logprob_rows=self.logprob_rows,
        )  # fmt: skip


def prepare_inputs(
    batch: ForwardBatch,
    spec: ModelSpec,
    allocator: HybridAllocator,
    *,
    check_slots: bool = True,
    logprob_rows: int = DEFAULT_LOGPROB_ROWS,
) -> _HostInputs:
    """Host tensors of one step, built with a fixed number of tensor ops plus one table slice
    per request. With page-table rows every slice is bounded by the window and the tokens new to
    the row, so the work is O(batch + window); without rows (``row=None``) each request's whole
    table is copied (O(tokens), kept for tests and tools that build batches by hand)."""
    reqs = batch.reqs
    for r in reqs:
        r.validate()
    paged = reqs[0].row is not None
    if any((r.row is not None) != paged for r in reqs):
        raise ValueError("ForwardBatch mixes requests with and without page-table rows")
    q_lens = [len(r.token_ids) for r in reqs]
    prefix = [r.prefix_len for r in reqs]
    seq = [p + q for p, q in zip(prefix, q_lens)]
    q_off = _offsets(q_lens)
    total = q_off[-1]
    parts: dict[str, torch.Tensor] = {
        "ids": torch.tensor(list(chain.from_iterable(r.token_ids for r in reqs)), dtype=torch.int64),
        "pos": _spread([p - o for p, o in zip(prefix, q_off)], q_lens, total),
    }
    window = spec.window or 0
    has_full, has_swa = bool(spec.full_layer_ids), bool(spec.swa_layer_ids)
    # NOTE: a repair has no SWA keys before its start (docs/design.md §9.8).
    swa_starts = [max(0 if r.repair is None else r.repair.start, p - window) for r, p in zip(reqs, prefix)]
    # The one slice per request, table[start:seq]: everything below is a sub-range of it.
    #   paged: from the first position the host must send (new to the row, the SWA window, or
    #          the new tokens), so its length is bounded by window + new tokens;
    #   flat:  from 0 when the model has full layers (the FULL view is the whole slice).
    if paged:
        starts = [min(r.synced, p, w if has_swa else p) for r, p, w in zip(reqs, prefix, swa_starts)]
    else:
        starts = [0] * len(reqs) if has_full else list(swa_starts) if has_swa else list(prefix)
    slots = torch.cat([r.table[s:n] for r, s, n in zip(reqs, starts, seq)]).to(torch.int64)
    ptr = _offsets([n - s for n, s in zip(seq, starts)])
    # What the new tokens write and the SWA layers read: the same, except repair rows.
    wslots = _with_repair_slots(slots, reqs, starts, seq, ptr)
    parts["out"] = wslots[_spread([e - q - o for e, q, o in zip(ptr[1:], q_lens, q_off)], q_lens, total)]
    full_rows: tuple[int, ...] | None = None
    if paged:
        full_rows = tuple(int(r.row) for r in reqs)  # type: ignore[arg-type]
        row_t = torch.tensor(full_rows, dtype=torch.int64)
        new = [n - r.synced for r, n in zip(reqs, seq)]
        if all(n == 1 for n in new) and total == len(reqs):  # decodes: the new slot is the entry
            parts["sync_row"], parts["sync_col"] = row_t, parts["pos"]
            parts["sync_val"] = slots[torch.tensor(ptr[1:], dtype=torch.int64) - 1]
        else:
            d_off = _offsets(new)
            sel = _spread([p + r.synced - s - o for p, r, s, o in zip(ptr, reqs, starts, d_off)], new, d_off[-1])
            parts["sync_row"] = torch.repeat_interleave(row_t, torch.tensor(new, dtype=torch.int64))
            parts["sync_col"] = _spread([r.synced - o for r, o in zip(reqs, d_off)], new, d_off[-1])
            parts["sync_val"] = slots[sel]
        parts["full_row"] = row_t
        parts["full_len"] = torch.tensor(seq, dtype=torch.int64)
    elif has_full:
        parts["full_idx"], parts["full_ptr"] = slots, torch.tensor(ptr)
    swa_view = None
    if has_swa:
        swa_view = _swa_view(allocator, wslots, ptr, starts, swa_starts, seq, q_lens)
        parts["swa_idx"], parts["swa_ptr"], parts["swa_out"] = swa_view
    if check_slots:
        _check_slots(parts)
    rows = [row for i, r in enumerate(reqs) for row in range(q_off[i + 1] - r.logit_rows, q_off[i + 1])]
    parts["rows"] = torch.tensor(rows, dtype=torch.int64)
    packed, spans = _pack(parts)
    return _HostInputs(
        packed, spans, full_rows, tuple(seq) if has_full else (),
        tuple(swa_starts) if has_swa else None,
        tuple(n - s for n, s in zip(seq, swa_starts)) if has_swa else (), max(seq),
        _prompt_pieces(reqs, q_off, logprob_rows),
    )  # fmt: skip


def _prompt_pieces(
    reqs: Sequence[ForwardReq], q_off: list[int], logprob_rows: int
) -> tuple[_PromptPiece, ...]:
    """Each request's prompt-logprob rows, cut into pieces of at most `logprob_rows`."""
    pieces = []
    for i, r in enumerate(reqs):
        rows = r.prompt_logprobs
        if rows is None:
            continue
        for k in range(0, len(rows.next_ids), logprob_rows):
            ids = rows.next_ids[k : k + logprob_rows]
            pieces.append(_PromptPiece(i, q_off[i] + rows.first + k, ids, rows.top_n))
    return tuple(pieces)


def _swa_view(
    allocator: HybridAllocator,
    slots: torch.Tensor,
    ptr: list[int],
    starts: list[int],
    swa_starts: list[int],
    seq: list[int],
    q_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SWA range of each request, cut out of `slots` and translated in ONE call: the SWA
    indices, their indptr, and the new tokens' SWA slots (the tail of each range)."""
    lens = [n - s for n, s in zip(seq, swa_starts)]
    swa_ptr = _offsets(lens)
    shifts = [p + (w - s) - o for p, w, s, o in zip(ptr, swa_starts, starts, swa_ptr)]
    full_idx = slots[_spread(shifts, lens, swa_ptr[-1])]
    swa_idx = allocator.translate(full_idx)  # the one translation
    q_off = _offsets(q_lens)
    tails = [e - q - o for e, q, o in zip(swa_ptr[1:], q_lens, q_off)]
    swa_out_loc = swa_idx[_spread(tails, q_lens, q_off[-1])]
    return swa_idx, torch.tensor(swa_ptr), swa_out_loc


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


def _check_slots(parts: dict[str, torch.Tensor]) -> None:
    """Slot 0 is the dummy page and -1 means "unmapped": neither may be read or written. Checks
    what crosses this step (O(batch + window)): the FULL entries new to the page table (older
    ones were checked when they were new), the flat FULL view, the SWA view and the new slots."""
    for name, kind in (("sync_val", "full"), ("full_idx", "full"), ("swa_idx", "swa")):
        t = parts.get(name)
        if t is not None and t.numel() and int(t.min()) <= 0:
            raise RuntimeError(
                f"a {kind} key slot in the batch is freed or unmapped (slot <= 0): the engine "
                "freed KV that a query still needs (SWA: the window before prefix_len must be live)"
            )
    out, swa_out = parts["out"], parts.get("swa_out")
    if int(out.min()) <= 0 or (swa_out is not None and swa_out.numel() and int(swa_out.min()) <= 0):
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

"""`ForwardBatch`: what the engine hands the model runner for one step.

Contract (the engine codes against this)
----------------------------------------
A batch mixes prefill chunks and decodes. For each request (`ForwardReq`):

- ``token_ids``: the new tokens of this step (a decode has exactly one; a prefill chunk any
  number ≥ 1). They sit at positions ``prefix_len … prefix_len + len(token_ids) - 1``.
- ``prefix_len``: tokens of this request already in the KV pools (cached prefix plus earlier
  chunks and decoded tokens) = the position of ``token_ids[0]``.
- ``table``: int64 CPU tensor of the request's FULL-pool slots by position, covering at least
  ``[0, prefix_len + len(token_ids))`` (a longer row, e.g. a view of a req-to-token row, is fine:
  only that prefix is read). ``table[prefix_len:]`` are the new tokens' slots, already allocated
  by the caller (``HybridAllocator.alloc_extend`` / ``alloc_decode``, which also set their SWA
  mapping). The runner writes the new K/V there; the caller owns the slots.
- ``row`` / ``synced``: the request's row in the runner's persistent page table on the model
  device (docs/design.md §18.1; the scheduler owns the row ids, one per running request, reused
  after it ends), and how many leading positions of that row already hold ``table[:synced]``.
  The runner writes only ``table[synced:seq_len]`` into the row (a decode: one entry), so a
  caller that rewrites ``table[p]`` for a ``p < synced`` must lower ``synced`` to ``p`` first.
  ``row=None`` (tests, tools): no persistent row; the runner copies ``table[:seq_len]`` into a
  flat host-built view every step (the O(tokens) path). A batch is all rows or all ``None``.
- ``need_logits``: False for a non-final prefill chunk (no token is sampled from it).
- ``prompt_logprobs``: the prompt logprobs this step's new tokens give (`PromptRows`): new token
  ``first + i`` is the distribution of ``next_ids[i]``, the prompt token after it. The runner
  turns those rows into logprobs itself, a bounded number of rows at a time
  (`ModelRunner.logprob_rows`, from the memory plan: docs/design.md §6.1), so a long chunk never
  holds ``[chunk x vocab]`` logits.
- ``repair``: set while the request repairs a tombstoned prefix (docs/design.md §9.8). Its rows
  at positions ``[repair.start, repair.end)`` recompute KV the tree already holds at
  ``table[repair.start:repair.end]``: every layer *reads* those cached slots for FULL keys, but
  the rows *write* their K/V to ``repair.slots`` (scratch full slots whose SWA twins hold the
  rebuilt SWA KV), and the SWA keys of the whole request start at ``repair.start``.

What must hold when `ModelRunner.forward` is called:

- FULL KV of positions ``[0, prefix_len)`` is present at ``table[:prefix_len]``.
- On hybrid models, positions ``[max(0, prefix_len - window), prefix_len)`` still have SWA slots
  (``allocator.translate(table[p]) > 0``): those are the keys the first new query sees on SWA
  layers. SWA slots of older positions may already be freed (``free_swa`` /
  ``free_out_of_window``) and reused by other requests; the runner never reads them.
- A request appears at most once per batch.

What the runner returns (`ForwardOutput`): float32 logits ``[batch.num_logits, vocab]``, one
row per request with ``need_logits`` (its last new token), in batch order; and per request with
``prompt_logprobs`` either its rows' `TokenLogprob`s or, when computing them failed for that
request alone, why (the engine ends that request; the others go on). It allocates and frees no
slot.

::

    positions:  0 ........ prefix_len-window ... prefix_len ...... prefix_len+n-1
    FULL reads: [==============================================================]
    SWA reads:                      [==================================]
    writes:                                          [======= new =====]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.outputs import TokenLogprob


@dataclass(frozen=True, slots=True)
class RepairRows:
    """The repair rows of a request: positions ``[start, start + len(slots))`` (§9.8)."""

    start: int
    slots: torch.Tensor  # int64, CPU: scratch full slots by position - start

    @property
    def end(self) -> int:
        return self.start + len(self.slots)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The prompt logprobs a request wants from one step: its new token ``first + i`` gives
    the logprob of ``next_ids[i]`` (the prompt token after it), with that row's top ``top_n``."""

    first: int
    next_ids: tuple[int, ...]
    top_n: int


@dataclass(frozen=True, slots=True)
class ForwardReq:
    """One request's part of a step (see the module docstring for the contract)."""

    token_ids: Sequence[int]
    prefix_len: int
    table: torch.Tensor  # int64, CPU: full-pool slots by position
    need_logits: bool = True
    prompt_logprobs: PromptRows | None = None  # rows the runner turns into prompt logprobs
    repair: RepairRows | None = None
    row: int | None = None  # the request's row of the device page table (None: no row)
    synced: int = 0  # positions of that row already holding table[:synced]

    @property
    def logit_rows(self) -> int:
        """Rows of the forward's logits that belong to this request."""
        return int(self.need_logits)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.token_ids)

    @property
    def repair_tokens(self) -> int:
        """New tokens of this step that are repair rows."""
        r = self.repair
        return 0 if r is None else max(0, min(self.seq_len, r.end) - self.prefix_len)

    def validate(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError("ForwardReq.token_ids is empty: every request needs >= 1 new token")
        if self.prefix_len < 0:
            raise ValueError(f"ForwardReq.prefix_len must be >= 0, got {self.prefix_len}")
        if self.table.numel() < self.seq_len:
            raise ValueError(
                f"ForwardReq.table has {self.table.numel()} slots but the request ends at "
                f"{self.seq_len}: allocate the new tokens' slots before the forward"
            )
        if self.row is not None and not 0 <= self.synced <= self.seq_len:
            raise ValueError(
                f"ForwardReq.synced must be in [0, {self.seq_len}] (the row's synced prefix), "
                f"got {self.synced}"
            )
        rows = self.prompt_logprobs
        if rows is not None and not 0 <= rows.first <= rows.first + len(rows.next_ids) <= len(self.token_ids):
            raise ValueError(
                f"ForwardReq.prompt_logprobs rows [{rows.first}, {rows.first + len(rows.next_ids)}) "
                f"are not among the {len(self.token_ids)} new tokens"
            )
        if self.repair is not None and not 0 <= self.repair.start <= self.prefix_len:
            raise ValueError(
                f"ForwardReq.repair starts at {self.repair.start}, after the first new token "
                f"({self.prefix_len}): a repair is fed from its start"
            )


@dataclass(frozen=True)
class ForwardBatch:
    """The requests of one forward step, in the order logits come back."""

    reqs: tuple[ForwardReq, ...]

    def __post_init__(self) -> None:
        if not self.reqs:
            raise ValueError("ForwardBatch needs at least one request")

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.reqs)

    @property
    def num_logits(self) -> int:
        return sum(r.logit_rows for r in self.reqs)


@dataclass(frozen=True)
class ForwardOutput:
    """What one forward gives back (the module docstring's contract)."""

    logits: torch.Tensor  # float32 [batch.num_logits, vocab], on the model's device
    # Batch index -> its `PromptRows`' logprobs, in order; or -> why computing them failed.
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    prompt_errors: dict[int, str] = field(default_factory=dict)

"""A minimal step loop over `ModelRunner` for tests (NOT the engine).

It allocates with `HybridAllocator` (alloc_extend for prefill chunks, alloc_decode for decode
steps), builds `ForwardBatch`es, samples greedily, and optionally frees out-of-window SWA KV after
every step with `free_out_of_window` (exact window, as the chunk cache does), so freed SWA pages go
back to the allocator and can be handed to other requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.geometry import Geometry
from worker.attention.base import AttentionBackend
from worker.attention.torch_backend import TorchBackend
from worker.kv import HybridAllocator, HybridKVPool, free_out_of_window
from worker.models.spec import ModelSpec
from worker.runner.forward_batch import ForwardBatch, ForwardReq
from worker.runner.model_runner import ModelRunner


@dataclass
class Seq:
    prompt: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # full slots by position
    kv_len: int = 0  # tokens whose KV is in the pools
    evicted: int = 0  # SWA frontier: positions below it have no SWA KV
    logits: list[torch.Tensor] = field(default_factory=list)
    freed_swa: set[int] = field(default_factory=set)  # SWA slots this request gave back
    swa_written: set[int] = field(default_factory=set)  # SWA slots its new tokens were written to

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.prompt)


class Driver:
    def __init__(
        self,
        spec: ModelSpec,
        model: torch.nn.Module,
        *,
        page_size: int,
        full_size: int = 2048,
        swa_size: int = 1024,
        hybrid: bool = True,
        chunk: int | None = None,
        free_swa: bool = False,
        backend: Callable[[HybridKVPool], AttentionBackend] = TorchBackend,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.allocator = HybridAllocator(
            full_size, swa_size, page_size, hybrid=hybrid and spec.has_swa
        )
        self.pool = HybridKVPool(spec, full_size, swa_size, page_size, dtype, device, hybrid=hybrid)
        self.runner = ModelRunner(
            spec, model, self.pool, self.allocator, backend(self.pool), device=device
        )
        self.page_size = page_size
        self.chunk = chunk
        self.free_swa = free_swa and spec.has_swa and hybrid

    def add(self, prompt: list[int], max_new: int) -> Seq:
        return Seq(list(prompt), max_new)

    # ---- one step -----------------------------------------------------------------------------
    def _new_tokens(self, seq: Seq) -> int:
        if seq.prefilling:
            left = len(seq.prompt) - seq.kv_len
            return left if self.chunk is None else min(self.chunk, left)
        return 1

    def _allocate(self, seqs: list[Seq], counts: list[int]) -> None:
        prefix = [s.kv_len for s in seqs]
        ends = [s.kv_len + n for s, n in zip(seqs, counts)]
        last = [s.table[s.kv_len - 1] if s.kv_len else -1 for s in seqs]
        if all(n == 1 and not s.prefilling for s, n in zip(seqs, counts)):
            slots = self.allocator.alloc_decode(ends, last)
        else:
            slots = self.allocator.alloc_extend(prefix, ends, last)
        assert slots is not None, "test pools too small"
        swa = self.allocator.translate(slots)
        for s, piece, swa_piece in zip(seqs, torch.split(slots, counts), torch.split(swa, counts)):
            s.table.extend(piece.tolist())
            s.swa_written.update(swa_piece.tolist())

    def step(self, seqs: list[Seq]) -> None:
        """One forward over every unfinished seq: a prefill chunk or one decode token each."""
        seqs = [s for s in seqs if not s.done]
        counts = [self._new_tokens(s) for s in seqs]
        self._allocate(seqs, counts)
        reqs = []
        for s, n in zip(seqs, counts):
            need = s.kv_len + n >= len(s.prompt)
            new = s.tokens[s.kv_len : s.kv_len + n]
            reqs.append(ForwardReq(new, s.kv_len, torch.tensor(s.table), need_logits=need))
        logits = self.runner.forward(ForwardBatch(tuple(reqs))).logits
        row = 0
        for s, r in zip(seqs, reqs):
            s.kv_len += len(r.token_ids)
            if r.need_logits:
                s.logits.append(logits[row])
                s.out.append(int(logits[row].argmax()))
                row += 1
        if self.free_swa:
            for s in seqs:
                self._free_out_of_window(s)

    def _free_out_of_window(self, s: Seq) -> None:
        table = torch.tensor(s.table)
        swa_before = self.allocator.translate(table)  # the mapping is zeroed by the free
        before = s.evicted
        s.evicted = free_out_of_window(
            self.allocator, table, Geometry(self.page_size, self.spec.window), evicted=s.evicted,
            protected=0, pre_len=s.kv_len, chunk_cache=True,
        )  # fmt: skip
        s.freed_swa.update(swa_before[before : s.evicted].tolist())

    def run(self, seqs: list[Seq]) -> None:
        while not all(s.done for s in seqs):
            self.step(seqs)

    def release(self, s: Seq) -> None:
        self.allocator.free(torch.tensor(s.table))
        s.table = []

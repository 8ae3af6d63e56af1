"""Copies between the device pools and the host tier, batched per step (docs/design.md §9.9).

The cache decides moves on the step thread while it schedules (an eviction offloads, an
admission loads) and records each as a `KVCopy` in the `TransferQueue`, in decision order; the
engine takes the step's `CopyBatch` and a `KVCopier` issues it just before that step's forward,
on the thread that runs forwards. The tree already shows the KV where it is going: nothing reads
a page between the decision and the copy except through the queue's order.

Why this order is enough (`LocalCopier` on CUDA; on CPU every copy runs at once, in order,
before the forward, which is the same protocol without streams):

1. The copy stream first waits for everything the forward stream has been given: an offload
   reads KV an earlier step's forward wrote (the tree holds a step's pages from its launch on),
   and a load may write a page an earlier forward still reads (a finished request's page).
2. One copy stream, in decision order: a device page an offload frees and a later decision of
   the same step reuses as a load target, or a host page a load frees and an offload reuses,
   is read before it is written.
3. The forward waits for the copies when it needs them (`CopyBatch.wait`): when the step loads,
   or when a device page offloaded since the last wait is allocated again (the allocator hands
   a freed page out at once, and the forward may write it). Otherwise the offloads overlap the
   forward, and a later forward that reuses their pages waits then (the copy stream holds them
   in order).
4. Host buffers are read and written only by copies, so the host thread never waits.

`KVCopier` is the seam a remote tier (a peer's host tier over Ray, NIXL) would plug into: it
would bring its own allocator of addresses and its own copier; the tree and the queue stay.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.kv.host_pool import HostKVPool, slot_pages
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.pool import HybridKVPool
from worker.models.spec import LayerKind


class Move(enum.Enum):
    OFFLOAD = "offload"  # device -> host
    LOAD = "load"  # host -> device


@dataclass(frozen=True, slots=True)
class KVCopy:
    """Every layer of one pool's KV of some whole pages, one way."""

    move: Move
    pool: LayerKind  # the device pool (and its host twin)
    device: torch.Tensor  # int64, CPU: device slots of whole pages, in order
    host: torch.Tensor  # int64, CPU: host slots, one per device slot


@dataclass(frozen=True, slots=True)
class CopyBatch:
    """One step's copies, in decision order; `wait`: the step's forward waits for them."""

    copies: tuple[KVCopy, ...]
    wait: bool


class KVCopier(Protocol):
    def issue(self, batch: CopyBatch) -> None:
        """Run (or enqueue) the copies before the next forward, on the thread that runs it."""
        ...


class TransferQueue:
    """The copies decided since the last `take`, and the tokens moved since start."""

    def __init__(self, allocator: HybridAllocator) -> None:
        self.allocator = allocator
        self._copies: list[KVCopy] = []
        self._unwaited: list[KVCopy] = []  # offloads issued since the last batch that waited
        self.moved: dict[tuple[Move, LayerKind], int] = {
            (m, k): 0 for m in Move for k in LayerKind
        }

    def add(self, move: Move, pool: LayerKind, device: torch.Tensor, host: torch.Tensor) -> None:
        assert device.shape == host.shape, (device.shape, host.shape)
        if device.numel():
            self._copies.append(KVCopy(move, pool, device, host))
            self.moved[move, pool] += device.numel()

    def __len__(self) -> int:
        return len(self._copies)

    def take(self) -> CopyBatch | None:
        """The copies to issue before the next forward (None: none), with whether that forward
        must wait for them (rule 3 of the module docstring)."""
        if not self._copies:
            return None
        copies, self._copies = tuple(self._copies), []
        offloads = [c for c in copies if c.move is Move.OFFLOAD]
        wait = len(offloads) < len(copies) or any(map(self._reused, self._unwaited + offloads))
        self._unwaited = [] if wait else self._unwaited + offloads
        return CopyBatch(copies, wait)

    def clear(self) -> None:
        """Forget copies not yet taken (a flush freed every page they name)."""
        self._copies.clear()

    def _reused(self, c: KVCopy) -> bool:
        pages = self.allocator.full if c.pool is LayerKind.FULL else self.allocator.swa
        P = self.allocator.page_size
        return any(pages.is_allocated(p) for p in slot_pages(c.device, P).tolist())


class LocalCopier:
    """Copies between this process's device pools and its host tier (see the module docstring;
    one copy stream on CUDA, in order on CPU)."""

    def __init__(self, device_pool: HybridKVPool, host_pool: HostKVPool) -> None:
        self.device_pool, self.host_pool = device_pool, host_pool
        self.device = device_pool.device
        self.page_size = host_pool.page_size
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    @torch.inference_mode()
    def issue(self, batch: CopyBatch) -> None:
        if self._stream is None:
            for c in batch.copies:
                self._copy(c)
            return
        forward = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(forward)  # rule 1
        with torch.cuda.stream(self._stream):
            for c in batch.copies:  # rule 2
                self._copy(c)
        if batch.wait:  # rule 3: the event follows every copy issued so far
            forward.wait_stream(self._stream)

    def _copy(self, c: KVCopy) -> None:
        ks, vs = self.device_pool.pool_buffers(c.pool)
        idx = c.device.to(self.device, non_blocking=True)
        pages = slot_pages(c.host, self.page_size)
        for bufs, host in ((ks, self.host_pool.k.get(c.pool)), (vs, self.host_pool.v.get(c.pool))):
            if host is None:
                continue  # addresses only (all-SWA model's full pool)
            if c.move is Move.OFFLOAD:
                _to_host(host, pages, _gather(bufs, idx, self.page_size))
            else:
                _scatter(bufs, idx, _from_host(host, pages, self.device))


def _gather(bufs: Sequence[torch.Tensor], idx: torch.Tensor, P: int) -> torch.Tensor:
    """Device rows of every layer -> [pages, layers, P, heads, dim] (the host layout)."""
    rows = torch.stack([b.index_select(0, idx) for b in bufs], dim=1)  # [n, layers, heads, dim]
    return rows.view(-1, P, *rows.shape[1:]).transpose(1, 2).contiguous()


def _scatter(bufs: Sequence[torch.Tensor], idx: torch.Tensor, pages: torch.Tensor) -> None:
    rows = pages.transpose(1, 2).reshape(idx.numel(), len(bufs), *pages.shape[3:])
    for layer, b in enumerate(bufs):
        b.index_copy_(0, idx, rows[:, layer])


def _to_host(host: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
    if src.device.type == "cpu":
        host.index_copy_(0, pages, src)
        return
    for lo, hi, first in _runs(pages.tolist()):  # one block copy per run of host pages
        host[first : first + hi - lo].copy_(src[lo:hi], non_blocking=True)


def _from_host(host: torch.Tensor, pages: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host.index_select(0, pages)
    out = torch.empty((pages.numel(), *host.shape[1:]), dtype=host.dtype, device=device)
    for lo, hi, first in _runs(pages.tolist()):
        out[lo:hi].copy_(host[first : first + hi - lo], non_blocking=True)
    return out


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(lo, hi, first page) of each run of consecutive pages in `pages[lo:hi]`."""
    out: list[tuple[int, int, int]] = []
    lo = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            out.append((lo, i, pages[lo]))
            lo = i
    return out

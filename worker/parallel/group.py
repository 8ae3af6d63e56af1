"""`TPGroup`: one rank's handle on its tensor-parallel group (docs/design.md §17).

Two process groups span the same ranks:

- ``device``: the collectives inside a step (the all-reduce after every row-parallel layer, the
  logits gather); NCCL on CUDA, gloo on CPU. Its timeout bounds a step: a peer that stops
  answering turns into an exception instead of a hang.
- ``control``: gloo on the host. Rank 0 broadcasts every step's prepared host tensors and the
  pool checks on it; ranks 1..N-1 wait on it while the engine is idle, so its timeout is long.

A peer process that dies closes its sockets: gloo raises at once (measured: within a few ms),
NCCL at the timeout. Either way the exception ends the rank's loop or the engine's step thread,
and the replica's health check reports it (docs/design.md §17.4).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

STEP_TIMEOUT_S = 600.0  # one collective inside a step (a first step may JIT-compile kernels)
IDLE_TIMEOUT_S = 365 * 24 * 3600.0  # ranks wait this long for the next step message
JOIN_TIMEOUT_S = 1800.0  # rank 0 waits this long for the others to load their shards
POLL_S = 0.05  # how often rank 0 looks for a failed rank while it waits
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TPAddress:
    """Where rank 0's rendezvous store listens (TCP)."""

    host: str
    port: int


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_store(host: str = LOOPBACK) -> tuple[dist.TCPStore, TPAddress]:
    """Rank 0's rendezvous store, on a port the OS picks; give the address to the other ranks."""
    store = dist.TCPStore(
        host, 0, is_master=True, timeout=_delta(JOIN_TIMEOUT_S), wait_for_workers=False
    )
    return store, TPAddress(host, store.port)


def connect_store(address: TPAddress) -> dist.TCPStore:
    return dist.TCPStore(
        address.host, address.port, is_master=False, timeout=_delta(JOIN_TIMEOUT_S)
    )


class TPGroup:
    """Rank `rank` of `size`; `device` is where this rank's weights and KV pools live. A single
    device is rank 0 of 1: no store, no process groups, every collective the identity.

    Built before the weights (sharding needs only rank and size) with the rendezvous `store`
    (rank 0's) and, on rank 0, `peers_failure` (why another rank is gone, or None); `join`
    connects it once this rank's shard is loaded, so a slow load never counts against a
    collective's timeout.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.Store | None = None,
        peers_failure: Callable[[], str | None] | None = None,
    ) -> None:
        assert size == 1 or store is not None, "ranks meet through a store"
        self.rank, self.size, self.device = rank, size, device
        self._store, self._peers_failure = store, peers_failure
        self._device_group: dist.ProcessGroup | None = None
        self._control_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def join(self) -> None:
        """Connect to the other ranks. Rank 0 first waits for every rank to announce itself,
        raising as soon as `peers_failure()` names one that is gone."""
        store = self._store
        if store is None:  # one rank: nothing to join
            return
        if dist.is_initialized():
            raise RuntimeError("this process is already in a process group: one TP engine each")
        store.set(f"loaded/{self.rank}", "1")
        if self.is_first:
            _wait_loaded(store, self.size, self._peers_failure or (lambda: None))
        # NOTE: `build_rank` made `self.device` current before the load (NCCL binds to it).
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=_delta(STEP_TIMEOUT_S),
        )
        self._device_group = dist.group.WORLD
        self._control_group = dist.new_group(backend="gloo", timeout=_delta(IDLE_TIMEOUT_S))

    # ---- inside a step (device group) ---------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `t`."""
        if self.size > 1:
            dist.all_reduce(t, group=self._device_group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `t` concatenated along the last dim, rank order; others: None."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_first else None
        dist.gather(t, parts, dst=0, group=self._device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    # ---- between steps (control group) --------------------------------------------------------
    def broadcast(self, obj: T | None = None) -> T:
        """Rank 0 sends `obj` (pickled host data); every rank returns it."""
        box: list[object] = [obj]
        if self.size > 1:
            dist.broadcast_object_list(box, src=0, group=self._control_group)
        return box[0]  # type: ignore[return-value]

    def gather(self, obj: T) -> list[T] | None:
        """Rank 0: every rank's `obj`, in rank order; others: None."""
        if self.size == 1:
            return [obj]
        out: list[T] | None = [obj] * self.size if self.is_first else None
        dist.gather_object(obj, out, dst=0, group=self._control_group)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank holds (every rank gets it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control_group)
        return int(t.item())

    def close(self) -> None:
        if self._device_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._device_group = self._control_group = None


def _wait_loaded(store: dist.Store, size: int, peers_failure: Callable[[], str | None]) -> None:
    keys = [f"loaded/{r}" for r in range(1, size)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        failure = peers_failure()
        if failure is not None:
            raise RuntimeError(f"tensor-parallel start failed: {failure}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks did not load their shards in {JOIN_TIMEOUT_S:.0f}s"
            )
        time.sleep(POLL_S)


def rank_device(device: str, rank: int, size: int) -> torch.device:
    """The device of `rank` of `size`: the configured one for a single rank or the CPU, else
    one CUDA device per rank.

    A rank sees either every GPU of the host (processes started here: rank r takes cuda:r) or
    only its own (a Ray actor with one GPU: cuda:0).
    """
    dev = torch.device(device)
    if dev.type != "cuda" or size == 1:
        return dev
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def use_loopback(address: TPAddress) -> None:
    """NOTE: gloo binds the interface the host name resolves to unless told otherwise; a group
    whose rendezvous is on loopback keeps its traffic there too. Call before `join`."""
    if address.host == LOOPBACK:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"

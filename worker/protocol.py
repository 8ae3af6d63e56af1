"""Plain dataclasses that cross process boundaries (DESIGN §4.3).

The worker's radix cache emits these; `cluster/` transports them and `router/` replays them
into a per-worker index. Nothing here imports torch, ray or HTTP code.

Pages are identified by *chained* hashes: ``h_i = H(h_{i-1}, tokens of page i)`` with
``h_{-1} = ROOT_HASH``, so one hash names a whole page-aligned prefix.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = 0


def _page_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *complete* page of `tokens` (a trailing partial page is ignored)."""
    out: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = _page_hash(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


class EventKind(str, enum.Enum):
    STORED = "stored"  # full and SWA KV now present for these pages
    REMOVED = "removed"  # full eviction: the pages are gone
    SWA_REMOVED = "swa_removed"  # became tombstones: full KV kept, SWA KV freed
    SWA_RESTORED = "swa_restored"  # tombstones revived with fresh SWA KV
    STORED_FULL_ONLY = "stored_full_only"  # stored as tombstones (SWA already out of window)
    CLEARED = "cleared"  # the whole cache was emptied


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: EventKind
    page_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class EventBatch:
    """Events of one drain, stamped with the worker's sequence number (1, 2, 3, …)."""

    worker_id: str
    incarnation: str
    seq: int
    events: tuple[CacheEvent, ...]


class PageState(str, enum.Enum):
    LIVE = "live"  # full + SWA KV present
    TOMBSTONE = "tombstone"  # full KV present, SWA KV freed


@dataclass(frozen=True)
class CacheSnapshot:
    """Every cached page of one worker at sequence number `seq` (for resync after a gap)."""

    worker_id: str
    incarnation: str
    seq: int
    pages: dict[int, PageState] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerMeta:
    """Sent once when a worker replica starts."""

    worker_id: str
    incarnation: str
    page_size: int
    window: int | None  # None: no SWA layer (every prefix with full KV is valid)
    full_tokens: int
    swa_tokens: int
    hybrid: bool

"""Builders for router tests: an index whose workers hold a prompt's pages in given states."""

from __future__ import annotations

from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, PoolHeadroom, WorkerLoad, WorkerMeta, WorkerResync
from core.events import ROOT_HASH, PageState, page_hashes
from core.geometry import Geometry
from core.reuse import TierCosts

PAGE = 4
WINDOW = 8  # two LIVE pages must end a match that crosses a tombstone
# One char per page state: L live, T tombstone, S SWA on the host, H host, X host tombstone.
STATES = {"L": PageState.LIVE, "T": PageState.TOMBSTONE, "S": PageState.SWA_HOST,
          "H": PageState.HOST, "X": PageState.HOST_TOMBSTONE}  # fmt: skip


def prompt(pages: int, base: int = 1000) -> list[int]:
    """A prompt whose matchable prefix (all but the last token) is exactly `pages` pages."""
    return list(range(base, base + pages * PAGE + 1))


def index_with(
    tokens: list[int],
    layout: dict[str, str],
    window: int | None = WINDOW,
    *,
    swa_layers: int = 0,
    repair: bool = False,
    tier_costs: TierCosts | None = None,
    root: int = ROOT_HASH,
) -> ClusterIndex:
    """layout: worker id → one char per page of tokens[:-1] (`STATES`, . absent), the pages
    named by `root`'s chain (a cache salt's, or none)."""
    chain = page_hashes(tokens[:-1], PAGE, root)
    index = ClusterIndex()
    for wid, states in layout.items():
        pages = {h: STATES[c] for h, c in zip(chain, states) if c != "."}
        meta = WorkerMeta(
            wid, "inc", Geometry(PAGE, window, swa_layers), full_tokens=1 << 16, swa_tokens=1 << 14,
            hybrid=True, tombstone_repair=repair, tier_costs=tier_costs,
        )  # fmt: skip
        index.resync(WorkerResync(meta, CacheSnapshot(wid, "inc", 0, pages)))
    return index


def load(
    wid: str,
    queued: int = 0,
    decodes: int = 0,
    free: int = 1 << 14,
    evictable: int = 0,
    at: float = 0.0,
) -> WorkerLoad:
    pool = PoolHeadroom(free, evictable, 1 << 16)
    return WorkerLoad(wid, at, 0, queued, decodes, pool, pool)

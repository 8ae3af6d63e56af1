"""The stall guard: scheduling is deterministic and only a forward or an abort frees memory, so
two steps in a row that schedule nothing while requests exist will repeat forever. The newest
request is refused with a clear error instead of hanging (e.g. an SWA pool barely above W + P
whose window locks leave a lone request no room)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.kv.hybrid_allocator import HybridAllocator
from worker.scheduler.plan import SchedulerLimits
from worker.scheduler.request import Req


class StallGuard:
    def __init__(self) -> None:
        self._idle_steps = 0  # consecutive steps that scheduled nothing while requests existed

    def victim(self, progressed: bool, running: Sequence[Req], waiting: Sequence[Req]) -> Req | None:
        """The request to refuse after this step, if scheduling is stuck."""
        if progressed or not (running or waiting):
            self._idle_steps = 0
            return None
        self._idle_steps += 1
        if self._idle_steps < 2:
            return None
        self._idle_steps = 0
        return running[-1] if running else waiting[0]


def stall_error(a: HybridAllocator, limits: SchedulerLimits) -> str:
    g = limits.geometry
    return (
        f"the KV pools cannot hold this request's next step (full pool {a.full_size} tokens, "
        f"SWA pool {a.swa_size} tokens, window {g.window}, page {g.page_size}); raise "
        "swa_full_tokens_ratio or the KV budget, or lower chunked_prefill_size"
    )

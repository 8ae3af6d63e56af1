"""`bench.routing.policy_latency`: decisions timed under an ingress replica's collector."""

from __future__ import annotations

import gc
from typing import Any

from bench.routing.policy_latency import _time_decisions
from deploy.replica.heap import GEN0_THRESHOLD, OLDER_THRESHOLDS


class _Core:
    def decide(self, *_: Any) -> tuple[tuple[int, ...], int]:
        return gc.get_threshold(), gc.get_freeze_count()


def test_a_settled_run_decides_under_the_ingress_collector_and_is_undone() -> None:
    core = _Core()
    seen: list[tuple[tuple[int, ...], int]] = []
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    samples = _time_decisions(core, lambda: seen.append(core.decide()), settled=True)  # type: ignore[arg-type]
    assert len(samples) == 1 and samples[0][0] >= 0
    assert seen[0][0] == (GEN0_THRESHOLD, *OLDER_THRESHOLDS) and seen[0][1] > frozen
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
    assert "decide" not in vars(core)  # the timing wrapper is gone
    _time_decisions(core, lambda: seen.append(core.decide()))
    assert seen[1] == (thresholds, frozen)  # unsettled: CPython's settings as they were

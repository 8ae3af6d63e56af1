"""`settle_heap`: a replica process's collector settings (run in a child: it freezes the heap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.replica.heap import GEN0_THRESHOLD, OLDER_THRESHOLDS

CHILD = """
import gc, json
garbage = []
garbage.append(garbage)  # a cycle: the collect before the freeze frees it
del garbage
kept = [object() for _ in range(1000)]
from deploy.replica.heap import settle_heap
settle_heap()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "young": gc.get_count()[0]}))
"""


def test_settle_heap_freezes_start_up_and_raises_the_thresholds() -> None:
    import json

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    got = json.loads(out.stdout)
    assert tuple(got["threshold"]) == (GEN0_THRESHOLD, *OLDER_THRESHOLDS)
    assert got["frozen"] >= 1000  # `kept` and the modules' objects are out of the collector's reach
    assert got["young"] < 100  # nothing was left in the first generation

"""The collector's view of an engine process: its start-up heap frozen (docs/design.md §20).

What start-up built (torch's and transformers' modules, the model, the pools' bookkeeping)
lives as long as the process. Frozen, it is out of the collector's reach: an oldest-generation
collection, which runs on whichever thread allocates (the step thread too, so every stream
waits on it), scans only what requests built since instead of the whole heap (110-120 ms
around the stand-in engine, ~4 ms frozen). vLLM's engine core freezes its start-up heap too.
The thresholds stay CPython's: frequent small young collections suit a step loop better than
rare large ones (the replicas raise theirs: `deploy/replica/heap.py`).
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect once and freeze what survives; returns how many objects are frozen. Call once
    an engine process (or a tensor-parallel rank) has built everything it keeps."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

"""The collector's settings of a replica process (ingress and worker alike).

What start-up built (the tokenizer, the chat template, the model's config, Ray's, Serve's and
FastAPI's modules) lives as long as the replica: frozen out of the collector's reach, a
collection scans only what requests allocated since. And a replica allocates for every token
it streams (coroutine frames, chunks, deltas), nearly all of it dead before the next token:
CPython's default first-generation threshold (700 allocations) runs a collection every few
tokens, which scans and promotes whatever is alive at that moment; at `GEN0_THRESHOLD` most of
it is gone by then. Measured with the Serve metrics interval below (`deploy.app.REPLICA_ENV`),
together: ingress + worker replica CPU per streamed token −8 % on `serving-ceiling` at c = 8
(BENCHMARKS "Serving ceiling").
"""

from __future__ import annotations

import gc

from worker.heap import freeze_heap

GEN0_THRESHOLD = 20_000  # allocations less deallocations between first-generation collections
OLDER_THRESHOLDS = (20, 20)  # collections of the younger generation per older one


def settle_heap() -> None:
    """Collect once, freeze what survives and raise the thresholds (call at the end of a
    replica's `__init__`; the process is the replica's alone)."""
    freeze_heap()
    gc.set_threshold(GEN0_THRESHOLD, *OLDER_THRESHOLDS)

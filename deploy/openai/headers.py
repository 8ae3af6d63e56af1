"""Response headers swaserve adds to every completion (the ingress sets them, clients read them)."""

from __future__ import annotations

from collections.abc import Sequence

REPLICA_HEADER = "x-swaserve-replica"  # the worker replica that served the request
# The router's predicted reused prompt tokens on that replica; equals the response's
# `usage.prompt_tokens_details.cached_tokens` when the router's index was current.
PREDICTED_CACHED_TOKENS_HEADER = "x-swaserve-predicted-cached-tokens"
# The prompt tokens after the cached ones that the worker recomputed to repair a prefix whose
# SWA KV was freed (docs/design.md §9.8), per choice; non-streamed responses only (a stream's
# headers leave before the engine admits the request). The router's prediction of it goes in
# the second header whenever the first prediction does.
REPAIRED_TOKENS_HEADER = "x-swaserve-repaired-tokens"
PREDICTED_REPAIRED_TOKENS_HEADER = "x-swaserve-predicted-repaired-tokens"


def per_choice(values: Sequence[int | None]) -> str:
    """One comma-separated entry per choice, empty where unknown."""
    return ",".join("" if v is None else str(v) for v in values)


def repair_headers(
    predicted: Sequence[int | None], served: Sequence[int] | None = None
) -> dict[str, str]:
    """The predicted (when any router predicted) and served (when known) repaired tokens."""
    out = {}
    if any(p is not None for p in predicted):
        out[PREDICTED_REPAIRED_TOKENS_HEADER] = per_choice(predicted)
    if served is not None:
        out[REPAIRED_TOKENS_HEADER] = per_choice(served)
    return out

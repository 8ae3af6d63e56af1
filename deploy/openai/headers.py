"""Response headers swaserve adds to every completion (the ingress sets them, clients read them)."""

from __future__ import annotations

from collections.abc import Sequence

from router.routing_record import Placement

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
# The KV tokens of the prompt the worker loaded from its host tier (docs/design.md §9.9), full
# and SWA counted apart, per choice (part of the cached tokens); non-streamed responses only, as
# above. Its prediction goes with the other two.
LOADED_TOKENS_HEADER = "x-swaserve-loaded-tokens"
PREDICTED_LOADED_TOKENS_HEADER = "x-swaserve-predicted-loaded-tokens"


def per_choice(values: Sequence[int | None]) -> str:
    """One comma-separated entry per choice, empty where unknown."""
    return ",".join("" if v is None else str(v) for v in values)


def prediction_headers(placements: Sequence[Placement | None]) -> dict[str, str]:
    """The router's predicted cached, repaired and loaded tokens, one entry per prompt's
    placement (None: no router placed it on the replica that served); none when no router
    predicted."""
    out = {}
    for header, values in (
        (PREDICTED_CACHED_TOKENS_HEADER, [p.predicted_cached_tokens if p else None for p in placements]),
        (PREDICTED_REPAIRED_TOKENS_HEADER, [p.predicted_repaired_tokens if p else None for p in placements]),
        (PREDICTED_LOADED_TOKENS_HEADER, [p.predicted_loaded_tokens if p else None for p in placements]),
    ):  # fmt: skip
        if any(v is not None for v in values):
            out[header] = per_choice(values)
    return out


def served_headers(repaired: Sequence[int], loaded: Sequence[int]) -> dict[str, str]:
    """The repaired and loaded tokens each choice really had (non-streamed responses)."""
    return {REPAIRED_TOKENS_HEADER: per_choice(repaired), LOADED_TOKENS_HEADER: per_choice(loaded)}

"""What the worker deployment sends back to the ingress (besides `worker.outputs.StreamDelta`).

Every `generate` stream starts with one `StreamStart`, so the ingress knows which replica took
the request (header `x-swaserve-replica`) and whether it was refused *before* it commits to an
HTTP status and starts streaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from worker.outputs import StreamDelta

RefusalKind = Literal["invalid", "unavailable"]  # -> HTTP 400 / 503


@dataclass(frozen=True)
class StreamStart:
    replica_id: str
    refusal: RefusalKind | None = None
    message: str | None = None  # why it was refused; says what to change
    predicted_cached_tokens: int | None = None  # the router's prediction for this replica
    routing_policy: str | None = None


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about the served model, fetched once by the ingress."""

    replica_id: str
    max_model_len: int
    model_dir: str
    page_size: int


class WorkerUnavailableError(RuntimeError):
    """The worker cannot finish this request (shutting down, engine gone); the ingress answers 503."""


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Coalesce consecutive deltas of one request into one (fewer Ray stream items under load)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    return StreamDelta(
        request_id=last.request_id,
        token_ids=tokens,
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_len=last.prompt_len,
        cached_tokens=last.cached_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=logprobs,
        error=last.error,
    )

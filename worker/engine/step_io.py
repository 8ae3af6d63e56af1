"""What one step hands the sampler and takes back (docs/design.md §4.1): the per-request
`SampleRow`s, the forward's prompt-logprob rows (`worker.engine.overlap` picks the sampling
rows) and the prompt logprobs those rows give; and what it hands each request's consumer: a
`StreamDelta` past the request's `StreamCursor`.

    logits of one forward, in batch order (ForwardReq.logit_rows per request):
      [ req A: 1 row ][ req B (all_logits): n rows ......... last ][ req C: 1 row ]
                 ▲ sample       prompt rows (positions) ─┘    ▲ sample (if it reaches the end)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.outputs import StreamDelta, TokenLogprob
from worker.runner.forward_batch import ForwardReq
from worker.runner.sampler import SampleRow, token_logprobs
from worker.scheduler.plan import StepWork
from worker.scheduler.request import Req, ReqState


def sample_row(req: Req, eos: frozenset[int]) -> SampleRow:
    p = req.params
    # The same set object every step (built once per request): the sampler keys its tensors on it.
    banned = p.banned_until_min_tokens(eos) if req.generated < p.min_tokens else frozenset()
    history = p.penalized
    return SampleRow(
        params=p,
        key=req.key,
        step=req.generated,  # tokens in flight included (overlap, docs/design.md §11.8)
        output_ids=req.output if history else (),
        prompt_ids=req.prompt if history and p.repetition_penalty != 1.0 else (),
        banned=banned,
        masked=req.grammar is not None,
    )


def prompt_logits(
    fwd: Sequence[ForwardReq], logits: torch.Tensor
) -> list[torch.Tensor | None]:
    """Per work item, its logits rows when it asked for all of them (None otherwise)."""
    per_item: list[torch.Tensor | None] = []
    offset = 0
    for f in fwd:
        n = f.logit_rows
        per_item.append(logits[offset : offset + n] if f.all_logits else None)
        offset += n
    assert offset == logits.shape[0], f"the runner returned {logits.shape[0]} rows, expected {offset}"
    return per_item


def chunk_prompt_logprobs(w: StepWork, rows: torch.Tensor) -> list[TokenLogprob]:
    """The prompt logprobs this chunk's rows give its request: the positions still missing, in
    order (the scheduler records them)."""
    req = w.req
    assert req.prompt_logprobs is not None and req.params.prompt_logprobs is not None
    positions = req.prompt_rows(w.start, w.n)
    if not positions:
        return []
    sub = rows[positions.start - w.start : positions.stop - w.start]
    next_ids = req.prompt[positions.start + 1 : positions.stop + 1]
    return token_logprobs(sub, next_ids, req.params.prompt_logprobs)


@dataclass(slots=True)
class StreamCursor:
    """What a request's consumer has been handed so far (the engine keeps one per request id)."""

    emitted: int = 0  # output tokens (and their logprobs)
    prompt_logprobs_sent: bool = False


def stream_delta(req: Req, cursor: StreamCursor) -> StreamDelta:
    """The request's news since `cursor`, which moves past it; the prompt logprobs go out once,
    all together, when every row is computed."""
    new = req.output[cursor.emitted :]
    lps = req.logprobs[cursor.emitted :] if req.logprobs is not None else None
    cursor.emitted = len(req.output)
    prompt_lps = None
    if req.prompt_logprobs is not None and not cursor.prompt_logprobs_sent:
        if len(req.prompt_logprobs) >= len(req.prompt) - 1:
            cursor.prompt_logprobs_sent = True
            prompt_lps = [None, *req.prompt_logprobs]
    return StreamDelta(
        request_id=req.rid,
        token_ids=new,
        finished=req.state is ReqState.FINISHED,
        finish_reason=req.finish_reason,
        prompt_len=len(req.prompt),
        cached_tokens=max(req.cached_tokens, 0),
        completion_tokens=len(req.output),
        logprobs=lps,
        error=req.error,
        prompt_logprobs=prompt_lps,
        repaired_tokens=req.repaired_tokens,
        loaded_tokens=req.loaded_tokens,
    )

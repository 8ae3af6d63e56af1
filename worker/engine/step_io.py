"""What one step hands the sampler and takes back (docs/design.md §4.1): the per-request
`SampleRow`s (`worker.engine.overlap` picks each one's logits row), and what it hands each
request's consumer: a `StreamDelta` past the request's `StreamCursor`. Prompt logprobs come
back from the runner already made (`ForwardOutput.prompt_logprobs`, by batch index):

    logits of one forward, in batch order (one row per request that samples):
      [ req A: 1 row ][ req B: 1 row, its last prompt token ][ req C: 1 row ]
    prompt logprobs: { B's index: [its prompt rows' TokenLogprobs, in order] }
"""

from __future__ import annotations

from dataclasses import dataclass

from core.outputs import StreamDelta
from worker.runner.sampler import SampleRow
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

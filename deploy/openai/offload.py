"""The ingress's per-request CPU work, off its event loop (docs/design.md §4.2).

Parsing a body, the checks, the chat template, tokenizing, rendering a response body (logprob
texts, an echoed prompt, prompt logprobs) and decoding for `/detokenize` cost time in the size of
what the client sent or asked for. On the event loop that time is everyone's: `/health` and every
other stream wait on a 4 MB prompt. Here it runs on a few threads: Hugging Face's tokenizers
release the GIL while they encode, and a chat template (Python) gives the loop its turn at every
GIL switch interval, so the loop keeps answering (measured: `/health` within tens of ms while a
4 MB prompt tokenizes for seconds, docs/design.md §4.2).

The threads are bounded (`threads`); what waits for one is bounded by admission and by Serve's
`max_ongoing_requests` of the ingress. A stream's per-token work stays on the loop when it is
small (`SMALL_DELTA`): a thread hop per token would cost more than the decode it moves. So is
a small request's preparation (`SMALL_BODY`): a body of a few KB parses, checks and tokenizes in
tens to hundreds of microseconds, about what the hop to a thread and back costs the process
(the wake-ups and GIL hand-overs of `run_in_executor`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# A stream delta with at most this many tokens (and no prompt logprobs, not an echo) is rendered
# on the loop: a few short decodes, microseconds.
SMALL_DELTA = 8
# A generation request whose body has at most this many bytes is prepared (parsed, checked, its
# template rendered and tokenized) on the loop: ~1,000 tokens of text at most, under a millisecond.
SMALL_BODY = 4096


class CpuPool:
    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ingress-cpu")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread. NOTE: cancelling the caller does not stop the call; it
        finishes on its thread and its result is dropped (each call is bounded work)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

"""`Req`: one request's life inside the engine (waiting → running → finished).

Token accounting. ``tokens = prompt + output``; the KV of positions ``[0, kv.kv_committed_len)``
is computed. A running request's next step feeds ``tokens[committed:]`` (or a chunk of it):

    prompt only, nothing computed:   |==== prompt ====|                 -> prefill (maybe chunked)
    decoding:                        |==== prompt ====|= out =|x|       -> feed x (the last token)
    retracted and requeued:          |==== prompt ====|= out =|         -> re-prefill all of it

The step that feeds the last of ``tokens`` samples the next token. Under overlap scheduling
(docs/design.md §11.8) a token sampled by a step still in flight counts in ``pending`` (it is
in ``tokens`` by count, not yet by value: the next decode feeds it as a future token id).

Fields set at construction (`follows`, `prompt_logprobs`, `grammar`) are constructor arguments;
every later change is the scheduler's (`worker.scheduler.scheduler`, one writer per field). What
a consumer has been handed (the stream cursor) is the engine's, kept by request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.outputs import FinishReason, TokenLogprob
from core.sampling_params import SamplingParams
from worker.cache.req_kv import ReqKV

if TYPE_CHECKING:
    from worker.structured.grammar import GrammarMatcher


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    key: int = 0  # the noise key of its draws (worker.runner.noise.seed_key)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    kv: ReqKV | None = None  # set while the request holds KV (running)
    state: ReqState = ReqState.WAITING
    cached_tokens: int = -1  # prompt tokens whose forward was skipped at first admission; -1 = not yet
    repaired_tokens: int = 0  # tokens recomputed at first admission to repair a tombstoned prefix
    loaded_tokens: int = 0  # prompt tokens whose KV came back from the host tier (first admission)
    finish_reason: FinishReason | None = None
    error: str | None = None
    retractions: int = 0
    # prompt_logprobs[p]: the logprob of prompt token p + 1 (the rows computed so far); [] when
    # the request asks for them, None otherwise
    prompt_logprobs: list[TokenLogprob] | None = None
    grammar: GrammarMatcher | None = None
    follows: str | None = None  # a sibling: admitted once that request's prompt is in the tree
    pending: int = 0  # tokens sampled by steps in flight, not appended yet (overlap, §11.8)
    rollback: int = -1  # kv_committed_len before its decode in flight: what ending it keeps

    @property
    def generated(self) -> int:
        """Output tokens, those still in flight included."""
        return len(self.output) + self.pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.generated

    @property
    def computed(self) -> int:
        return self.kv.kv_committed_len if self.kv is not None else 0

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample."""
        return self.num_tokens - self.computed

    @property
    def is_decoding(self) -> bool:
        return self.kv is not None and self.generated > 0 and self.remaining == 1

    @property
    def max_len(self) -> int:
        """The most positions this request can ever occupy."""
        return len(self.prompt) + self.params.max_tokens

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def reusable(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last, except
        the prompt rows whose logprobs are still to compute (their logits are needed)."""
        n = self.num_tokens - 1
        return n if self.prompt_logprobs is None else min(n, len(self.prompt_logprobs))

    def prompt_rows(self, start: int, n: int) -> range:
        """Positions in ``[start, start + n)`` whose logits give prompt logprobs still missing."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + n, len(self.prompt) - 1))

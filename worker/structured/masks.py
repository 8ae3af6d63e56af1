"""The token bitmask of one step, filled off the critical path (docs/design.md §4.1).

The engine starts the fill before the forward and waits for it before sampling: llguidance
computes the masks with the GIL released (in parallel over the batch's matchers), so the
model's forward and the grammar work overlap instead of adding up.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker.structured.grammar import GrammarMatcher


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._executor: object | None = None  # llguidance.LLExecutor, created on first use

    def start(self, matchers: list[GrammarMatcher | None]) -> Future[torch.Tensor] | None:
        """Begin filling int32 ``[len(matchers), ceil(vocab / 32)]`` (rows without a matcher
        allow everything); None when no row has a grammar."""
        if all(m is None for m in matchers):
            return None
        if self._pool is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="swaserve-grammar")
        return self._pool.submit(self._fill, matchers)

    def _fill(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
        from llguidance.torch import fill_next_token_bitmask_par

        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        rows = [(m.matcher, i) for i, m in enumerate(matchers) if m is not None]
        fill_next_token_bitmask_par(self._executor, rows, bitmask)  # type: ignore[arg-type]
        return bitmask

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

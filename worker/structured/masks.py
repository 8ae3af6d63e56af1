"""The token bitmask of one step, filled off the critical path (docs/design.md §4.1).

The engine starts the fill before the forward and waits for it before sampling: llguidance
computes the masks with the GIL released (in parallel over the batch's matchers), so the
model's forward and the grammar work overlap instead of adding up.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker.structured.grammar import GrammarMatcher

logger = logging.getLogger(__name__)


Row = tuple[GrammarMatcher | None, int]  # a sampler's matcher (None: no grammar), its output length


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._executor: object | None = None  # llguidance.LLExecutor, created on first use

    def start(self, rows: list[Row]) -> Future[torch.Tensor] | None:
        """Begin filling int32 ``[len(rows), ceil(vocab / 32)]``; None when no row has a grammar.

        A row is the grammar's mask only when its matcher has consumed exactly the request's
        output so far; any other row (no grammar: the sampler does not read it; a matcher out of
        step) allows nothing, so a request is never sampled from logits its grammar did not
        constrain (the sampler then reports the row as unsampled and the engine ends it alone)."""
        if all(m is None for m, _ in rows):
            return None
        if self._pool is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="swaserve-grammar")
        return self._pool.submit(self._fill, rows)

    def _fill(self, rows: list[Row]) -> torch.Tensor:
        from llguidance.torch import fill_next_token_bitmask_par

        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        ready = [(m, i) for i, (m, n) in enumerate(rows) if m is not None and m.consumed == n]
        for i, (m, n) in enumerate(rows):
            if m is not None and m.consumed != n:
                logger.error("grammar row %d: matcher at %d tokens, output at %d: row denied", i, m.consumed, n)
        if not ready:
            return bitmask
        try:
            pairs = [(m.matcher, i) for m, i in ready]
            fill_next_token_bitmask_par(self._executor, pairs, bitmask)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - one grammar's failure must not deny every row
            logger.exception("the batch's grammar masks failed; filling them one by one")
            self._fill_alone(ready, bitmask)
        return bitmask

    @staticmethod
    def _fill_alone(ready: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Each row on its own: a row whose grammar raises allows nothing and says why (its
        request then ends alone: the sampler finds no token for it)."""
        from llguidance.torch import fill_next_token_bitmask

        for m, i in ready:
            try:
                fill_next_token_bitmask(m.matcher, bitmask, i)
            except Exception:  # noqa: BLE001 - that request's alone
                logger.exception("grammar mask of row %d failed", i)
                bitmask[i] = 0
                m.failed = m.failed or "the grammar could not compute the tokens allowed next"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

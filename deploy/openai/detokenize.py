"""Incremental detokenization and stop strings at the ingress.

Workers stream token ids; the ingress turns them into text deltas. Decoding token by token is
wrong for byte-level BPE (a character may span tokens) and for SentencePiece (leading spaces
depend on the previous token), so the detokenizer keeps a small window of context tokens and
emits only text that is stable (vLLM's prefix/read offset scheme):

    tokens:  ...... [prefix_offset ........ read_offset) [new tokens ...]
                     context, already emitted              decoded together with the context;
                                                           the text beyond the context's is new
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence decodes to this


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, context_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens as context so the first generated token gets its leading space.
        self._ids: list[int] = list((context_ids or [])[-4:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly stable text (everything left when `final`)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing stable yet (e.g. half of a multi-byte character)
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]


@dataclass
class TextPiece:
    text: str
    stopped: bool  # a stop string was found; the text ends before it


class StopTextStream:
    """Detokenizes a choice's tokens and cuts the text at the first stop string.

    While a stop string could still be forming, the last `len(longest stop) - 1` characters are
    held back so the client never sees a partial stop string. The first `min_tokens` tokens'
    text is never searched (no stop before min_tokens, as the engine does).
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        context_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)
        self._unchecked = min_tokens  # tokens still to pass before stop strings count
        self._floor = 0  # stop strings are searched from here on
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, token_ids: list[int], final: bool) -> TextPiece:
        if self.stopped:
            return TextPiece("", True)
        if self._unchecked:
            head, token_ids = token_ids[: self._unchecked], token_ids[self._unchecked :]
            self._unchecked -= len(head)
            self._text += self._detok.push(head, final and not token_ids)
            self._floor = len(self._text)
            if not token_ids:
                piece, self._sent = self._text[self._sent :], len(self._text)
                return TextPiece(piece, False)
        self._text += self._detok.push(token_ids, final)
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            piece, self._sent = self._text[self._sent : cut], cut
            return TextPiece(piece, True)
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        piece, self._sent = self._text[self._sent : end], end
        return TextPiece(piece, False)

    def _find_stop(self) -> int | None:
        """Where the text ends at the first stop string (after it when it is kept)."""
        # Search only where a new match can start: the held-back tail plus the new text.
        start = max(self._floor, self._sent - self._hold)
        hits = [(i, len(s)) for s in self._stop if (i := self._text.find(s, start)) >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self._include_stop else at

    @property
    def text(self) -> str:
        return self._text[: self._sent]

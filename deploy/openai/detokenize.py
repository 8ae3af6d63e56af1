"""Incremental detokenization and stop strings at the ingress.

Workers stream token ids; the ingress turns them into text deltas. Decoding token by token is
wrong for byte-level BPE (a character may span tokens) and for SentencePiece (leading spaces
depend on the previous token), so the detokenizer keeps a small window of context tokens and
emits only text that is stable (vLLM's prefix/read offset scheme, the tokens before the window
dropped):

    _ids:  [ context, already emitted ) [ held and new tokens ... ]
           0                      _read
           decoded together with the context; the text beyond the context's is new
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence decodes to this

# Tokens whose text ends in an incomplete character are held back, but not past this many: then
# the text goes out up to the last token boundary where it is whole (a character spans at most 4
# tokens), or, when there is none (no text at all: a run of byte tokens forced by logit_bias, or
# invalid UTF-8), as it decodes, U+FFFD included. So a push costs O(1) whatever the tokens; with
# no bound such a run was decoded again in full with every token (quadratic).
MAX_HELD = 16
# Tokens of emitted output kept as context for the next push (the leading space of a
# SentencePiece token depends on the token before it).
CONTEXT = 4


def rust_backend(tokenizer: Any, *methods: str) -> Any | None:
    """The tokenizer's Rust `tokenizers` backend when it is a fast tokenizer whose class keeps
    transformers' own `methods` (what those do is then known: the callers' shortcuts rely on
    it); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if any(getattr(cls, m) is not getattr(PreTrainedTokenizerFast, m) for m in methods):
        return None
    return backend


def backend_decoder(tokenizer: Any) -> Any | None:
    """The Rust tokenizer whose `decode(ids, skip_special_tokens=)` gives the same text as
    `tokenizer.decode`, when there is one: a fast tokenizer whose class keeps transformers'
    own `decode`/`_decode` and cleans up no spaces. That call skips transformers' Python layers
    (argument conversion, the clean-up check): ~1 µs instead of ~3.3 per decode here, and a
    push decodes twice. Else None (decode through the tokenizer)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return rust_backend(tokenizer, "decode", "_decode")


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, context_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        backend = backend_decoder(tokenizer)
        self._tok = tokenizer if backend is None else backend
        self._skip = skip_special_tokens
        # A few prompt tokens as context so the first generated token gets its leading space.
        self._ids: list[int] = list((context_ids or [])[-CONTEXT:])
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly stable text (everything left when `final`)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[: self._read])
        full_text = self._decode(self._ids)
        if final or _whole(full_text, prefix_text):
            return self._emit(len(self._ids), full_text, prefix_text)
        if len(self._ids) - self._read < MAX_HELD:
            return ""  # nothing stable yet (e.g. half of a multi-byte character)
        for end in range(len(self._ids) - 1, max(self._read, len(self._ids) - 5), -1):
            text = self._decode(self._ids[:end])
            if _whole(text, prefix_text):
                return self._emit(end, text, prefix_text)
        return self._emit(len(self._ids), full_text, prefix_text)

    def _emit(self, end: int, text: str, prefix_text: str) -> str:
        """The text of the tokens before `end` goes out; the last CONTEXT of them stay as the
        next push's context (all of them would make a large push costly for every later one)."""
        start = max(self._read, end - CONTEXT)
        del self._ids[:start]
        self._read = end - start
        return text[len(prefix_text) :]


def _whole(text: str, prefix_text: str) -> bool:
    """`text` adds to the context's and does not end inside a character."""
    return len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT)


@dataclass
class TextPiece:
    text: str
    stopped: bool  # a stop string was found; the text ends before it


class StopTextStream:
    """Detokenizes a choice's tokens and cuts the text at the first stop string.

    While a stop string could still be forming, the last `len(longest stop) - 1` characters are
    held back so the client never sees a partial stop string. The first `min_tokens` tokens'
    text is never searched (no stop before min_tokens, as the engine does). Only the held-back
    tail and the new text are kept and searched, so a feed costs O(its text + the hold).

        text:  [ sent (kept in `_sent_parts`) ........ | _buf: hold tail of sent | unsent ]
                                               _base ─┘              _sent ─┘
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
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        # Offsets count characters of the whole text; `_buf` holds text[_base:].
        self._buf = ""
        self._base = 0
        self._floor = 0  # stop strings are searched from here on
        self._sent = 0
        self._sent_parts: list[str] = []
        self.stopped = False

    def feed(self, token_ids: list[int], final: bool) -> TextPiece:
        if self.stopped:
            return TextPiece("", True)
        if self._unchecked:
            head, token_ids = token_ids[: self._unchecked], token_ids[self._unchecked :]
            self._unchecked -= len(head)
            self._buf += self._detok.push(head, final and not token_ids)
            self._floor = self._end
            if not token_ids:
                return TextPiece(self._send(self._end), False)
        self._buf += self._detok.push(token_ids, final)
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return TextPiece(self._send(cut), True)
        return TextPiece(self._send(self._end if final else max(self._sent, self._end - self._hold)), False)

    @property
    def _end(self) -> int:
        return self._base + len(self._buf)

    def _send(self, end: int) -> str:
        """Text up to `end` goes out; the buffer keeps what a later stop search can still read."""
        piece = self._buf[self._sent - self._base : end - self._base]
        self._sent = max(self._sent, end)
        self._sent_parts.append(piece)
        keep = min(self._sent, max(self._floor, self._sent - self._hold))
        self._buf, self._base = self._buf[keep - self._base :], keep
        return piece

    def _find_stop(self) -> int | None:
        """Where the text ends at the first stop string (after it when it is kept)."""
        # Search only where a new match can start: the held-back tail plus the new text.
        start = max(self._floor, self._sent - self._hold) - self._base
        hits = [(i, len(s)) for s in self._stop if (i := self._buf.find(s, start)) >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return self._base + (at + length if self._include_stop else at)

    @property
    def text(self) -> str:
        return "".join(self._sent_parts)

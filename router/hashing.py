"""Page-hash chains for routing, computed lazily and memoised.

The values are exactly `core.events.page_hashes` (a test checks it on random input): same
blake2b-8 over ``parent (u64 LE) || tokens (i64 LE)``, same 63-bit mask, and the chain starts
from the same root hash (a request's cache salt's, docs/design.md §9.10; ROOT_HASH without one). Three things make it fast
enough for a sub-millisecond decision on a 4k-token prompt:

- all tokens are packed once (one `struct.pack`), each page hashes a slice of that buffer;
- hashes are memoised by (parent, page bytes) in a bounded two-generation dict, so the shared
  prefixes the router exists for cost a dict lookup per page after their first request;
- the chain is a generator: the matcher stops pulling pages once no worker holds the next one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

from core.events import ROOT_HASH

_MASK_63 = 0x7FFF_FFFF_FFFF_FFFF
_PACK_PARENT = struct.Struct("<Q").pack


class PageHasher:
    """Chained page hashes with a bounded memo (about `memo_pages` entries, ~350 B each)."""

    def __init__(self, memo_pages: int = 1 << 15) -> None:
        if memo_pages < 2:
            raise ValueError(f"memo_pages must be >= 2, got {memo_pages}")
        self._half = memo_pages // 2
        self._young: dict[tuple[int, bytes], int] = {}
        self._old: dict[tuple[int, bytes], int] = {}

    def iter_hashes(
        self, tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH
    ) -> Iterator[int]:
        """Yield h_0, h_1, … for every complete page of `tokens` (a partial page is ignored)."""
        n = len(tokens) // page_size * page_size
        if n == 0:
            return
        buf = struct.pack(f"<{n}q", *tokens[:n])
        stride = page_size * 8
        young = self._young
        for start in range(0, n * 8, stride):
            key = (parent, buf[start : start + stride])
            value = young.get(key)  # the hot path: one dict lookup per page
            if value is None:
                value = self._miss(key)
                young = self._young  # a miss may have started a new generation
            parent = value
            yield value

    def hashes(self, tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
        return list(self.iter_hashes(tokens, page_size, parent))

    def _miss(self, key: tuple[int, bytes]) -> int:
        value = self._old.get(key)
        if value is None:
            digest = hashlib.blake2b(_PACK_PARENT(key[0]) + key[1], digest_size=8).digest()
            value = int.from_bytes(digest, "little") & _MASK_63
        if len(self._young) >= self._half:
            self._old, self._young = self._young, {}
        self._young[key] = value
        return value

"""Page-hash chains for routing, computed lazily and memoised.

The values are exactly `core.events.page_hashes` (a test checks it on random input): same
blake2b-8 over ``parent (u64 LE) || tokens (i64 LE)``, same 63-bit mask, and the chain starts
from the same root hash (a request's cache salt's, docs/design.md §9.10; ROOT_HASH without one). Three things make it fast
enough for a sub-millisecond decision on a 4k-token prompt:

- all tokens are packed once (one `array` conversion, a C loop: `struct.pack(*tokens)` first
  builds an argument tuple and costs ~30 µs on a 2k-token prompt), each page hashes a slice;
- hashes are memoised by the bytes hashed (parent || page) in a bounded two-generation dict, so the shared
  prefixes the router exists for cost a dict lookup per page after their first request;
- the chain is a generator: the matcher stops pulling pages once no worker holds the next one.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence

from core.events import ROOT_HASH

_MASK_63 = 0x7FFF_FFFF_FFFF_FFFF
_PACK_PARENT = struct.Struct("<Q").pack
_SWAP = sys.byteorder != "little"
_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def _pack(tokens: Sequence[int], n: int) -> bytes:
    """The first `n` tokens as i64 little-endian (`struct.pack(f"<{n}q", ...)`'s bytes)."""
    packed = array("q", tokens[:n] if n < len(tokens) else tokens)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


class PageHasher:
    """Chained page hashes with a bounded memo (about `memo_pages` entries, ~350 B each)."""

    def __init__(self, memo_pages: int = 1 << 15) -> None:
        if memo_pages < 2:
            raise ValueError(f"memo_pages must be >= 2, got {memo_pages}")
        self._half = memo_pages // 2
        # NOTE: keyed by the hashed bytes themselves (parent u64 || page tokens), not a
        # (parent, bytes) tuple: bytes are no garbage-collected objects, so the ~100 new pages a
        # prompt adds to the memo do not bring the next collection closer (tuples would, and it
        # then lands inside a decision).
        self._young: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}

    def iter_hashes(
        self, tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH
    ) -> Iterator[int]:
        """Yield h_0, h_1, … for every complete page of `tokens` (a partial page is ignored)."""
        n = len(tokens) // page_size * page_size
        if n == 0:
            return
        buf = _pack(tokens, n)
        stride = page_size * 8
        young = self._young
        for start in range(0, n * 8, stride):
            key = _PACK_PARENT(parent) + buf[start : start + stride]
            value = young.get(key)  # the hot path: one dict lookup per page
            if value is None:
                value = self._old.get(key)
                if value is None:  # NOTE: inline, no helper call: once per new page
                    value = _from_bytes(_blake2b(key, digest_size=8).digest(), "little") & _MASK_63
                young = self._young  # another chain's walk may have started a generation
                if len(young) >= self._half:  # a new generation
                    self._old, self._young = young, {}
                    young = self._young
                young[key] = value
            parent = value
            yield value

    def hashes(self, tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
        return list(self.iter_hashes(tokens, page_size, parent))

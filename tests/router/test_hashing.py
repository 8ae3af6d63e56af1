"""PageHasher reproduces core.events.page_hashes exactly, memoised or not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.events import page_hashes
from router.hashing import PageHasher


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=70), st.sampled_from([1, 2, 4, 16]))
def test_same_values_as_protocol(tokens: list[int], page: int) -> None:
    """Both the first (hashing) and second (memo) computation equal the protocol's chain."""
    hasher = PageHasher(memo_pages=8)
    expected = page_hashes(tokens, page)
    assert hasher.hashes(tokens, page) == expected
    assert hasher.hashes(tokens, page) == expected


def test_memo_is_bounded() -> None:
    """The memo never holds more than about memo_pages entries."""
    hasher = PageHasher(memo_pages=16)
    hasher.hashes(list(range(400)), 2)
    assert len(hasher._young) + len(hasher._old) <= 16


def test_partial_page_ignored() -> None:
    """A prompt shorter than a page has no hashes."""
    assert PageHasher().hashes([1, 2, 3], 4) == []

"""PageHasher reproduces core.events.page_hashes exactly, memoised or not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.events import page_hashes, salted_root
from router.hashing import PageHasher


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-(2**40), 2**40), max_size=70),
    st.sampled_from([1, 2, 4, 16]),
    st.sampled_from([None, "tenant-a", "tenant-b"]),
)
def test_same_values_as_protocol(tokens: list[int], page: int, salt: str | None) -> None:
    """Both the first (hashing) and second (memo) computation equal the protocol's chain, from
    the same root hash (a cache salt's or none)."""
    hasher = PageHasher(memo_pages=8)
    root = salted_root(salt)
    expected = page_hashes(tokens, page, root)
    assert hasher.hashes(tokens, page, root) == expected
    assert hasher.hashes(tokens, page, root) == expected


def test_salted_chains_share_no_page() -> None:
    """The same tokens under two salts (or none) hash to disjoint chains, memo or not."""
    hasher, tokens = PageHasher(), list(range(64))
    chains = [set(hasher.hashes(tokens, 4, salted_root(s))) for s in (None, "a", "b", None)]
    assert chains[0] == chains[3]
    assert not (chains[0] & chains[1] or chains[0] & chains[2] or chains[1] & chains[2])


def test_memo_is_bounded() -> None:
    """The memo never holds more than about memo_pages entries."""
    hasher = PageHasher(memo_pages=16)
    hasher.hashes(list(range(400)), 2)
    assert len(hasher._young) + len(hasher._old) <= 16


def test_partial_page_ignored() -> None:
    """A prompt shorter than a page has no hashes."""
    assert PageHasher().hashes([1, 2, 3], 4) == []

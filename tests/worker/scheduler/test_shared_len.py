"""`shared_len`: the common head of two token lists, compared a block at a time."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.scheduler.scheduler import shared_len


@given(st.lists(st.integers(0, 3), max_size=300), st.integers(0, 300),
       st.lists(st.integers(0, 3), max_size=100), st.integers(1, 80))  # fmt: skip
def test_shared_len_is_the_common_head(a: list[int], keep: int, tail: list[int], step: int) -> None:
    b = a[:keep] + tail  # a long common head is the case that matters
    limit = min(len(a), len(b))
    want = next((i for i in range(limit) if a[i] != b[i]), limit)
    assert shared_len(a, b, limit, step) == want
    assert shared_len(a, b, limit // 2, step) == min(want, limit // 2)

"""The valid-match rule (docs/design.md §4.4) read literally: the oracle `router.match` and the
fake workers of the Ray tests are checked against."""

from __future__ import annotations

from collections.abc import Sequence

from core.events import PageState


def valid_match_reference(
    states: Sequence[PageState | None], page_size: int, window: int | None
) -> int:
    """The largest valid k: states[i] is page i on the worker, None = absent."""
    full = next((i for i, s in enumerate(states) if s is None), len(states))
    for k in range(full, 0, -1):
        prefix = states[:k]
        if window is None or PageState.TOMBSTONE not in prefix:
            return k
        run = 0
        for state in prefix:
            run = run + page_size if state is PageState.LIVE else 0
        if run >= window:
            return k
    return 0

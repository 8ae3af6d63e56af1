"""Cache tests run with the SWA eviction policy `lru` (SGLang's order, the behaviour they were
written for) unless a module opts into both policies with
``pytestmark = pytest.mark.usefixtures("both_policies")``: its rules must hold either way."""

from __future__ import annotations

from collections.abc import Iterator

import cache_helpers
import pytest


@pytest.fixture(params=["lru", "tail_first"])
def both_policies(request: pytest.FixtureRequest) -> Iterator[str]:
    before = cache_helpers.DEFAULT_SWA_POLICY
    cache_helpers.DEFAULT_SWA_POLICY = request.param
    yield request.param
    cache_helpers.DEFAULT_SWA_POLICY = before

"""`swaserve bench routing --real` on one policy and a handful of requests: the real stack comes
up on loopback, the tenants' shared prompts are reused, and the router's header predicts the
cached tokens the worker reports."""

from __future__ import annotations

import pytest

from bench.routing.real import RealSettings, real_summary, run_real
from bench.routing.real_traffic import Traffic

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def test_real_stack_reuses_shared_prompts_with_exact_predictions() -> None:
    """Sequential requests: every response carries a prediction equal to its cached tokens, and
    the tenants' later requests reuse their system prompt."""
    traffic = Traffic(tenants=2, tenant_requests=4, chats=1, turns=2, max_tokens=4)
    result = run_real(RealSettings(policies=("swa_prefix",), traffic=traffic))
    (p,) = result.policies
    assert p.requests == 4 + 2 and p.predictions == p.requests
    assert p.predictions_exact == p.requests and p.predictions_over == 0
    tenants = [s for s in p.samples if s.kind == "tenant"]
    assert [s.cached_tokens > 0 for s in tenants] == [False, False, True, True]
    assert (
        sum(p.per_replica.values()) == p.requests
        and p.prefill_tokens == p.prompt_tokens - p.cached_tokens
    )
    assert "| swa_prefix | 6 |" in real_summary(result)

"""Placement: the SWA-valid prefix match over the cluster index, policies, the Serve router.

The Serve adapter is `router.serve_router:SwaPrefixRequestRouter` (imports ray.serve; not
re-exported here). See router/README.md.
"""

from router.core import Candidate, RouterCore
from router.policies import DEFAULT_POLICY, POLICIES, make_policy
from router.request import PREDICTED_CACHED_TOKENS_HEADER, RoutedRequest, RoutingDecision

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "PREDICTED_CACHED_TOKENS_HEADER",
    "Candidate",
    "RoutedRequest",
    "RouterCore",
    "RoutingDecision",
    "make_policy",
]

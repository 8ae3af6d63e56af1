"""Placement: the SWA-valid prefix match over the cluster index, policies, the Serve router.

The Serve adapter is `router.serve_router:SwaPrefixRequestRouter` (imports ray.serve; not
re-exported here). See router/README.md.
"""

from router.core import Candidate, RouterCore
from router.policies import DEFAULT_POLICY, POLICIES, make_policy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Candidate",
    "RouterCore",
    "make_policy",
]

"""A call that must reach one named replica of the worker deployment, or none.

The router sends a call whose first argument is a `PinnedCall` to that replica only
(`router.serve_router`); when the replica is not among the candidates (gone, not yet known)
it ranks them all and the replica that gets the call refuses it, so the caller fails at once
instead of Serve retrying a replica that will never come back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PinnedCall:
    replica_id: str  # Serve's short replica id (`ReplicaID.unique_id`)

"""Placement: the SWA-valid prefix match over the cluster index, policies, the Serve router."""

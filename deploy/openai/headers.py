"""Response headers swaserve adds to every completion (the ingress sets them, clients read them)."""

REPLICA_HEADER = "x-swaserve-replica"  # the worker replica that served the request
# The router's predicted reused prompt tokens on that replica; equals the response's
# `usage.prompt_tokens_details.cached_tokens` when the router's index was current.
PREDICTED_CACHED_TOKENS_HEADER = "x-swaserve-predicted-cached-tokens"

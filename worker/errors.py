"""Errors the worker raises: for bad user input (configs, model files, memory budgets), every
message says what to change and callers at the edges (`deploy/`) show it verbatim; and
`EngineGoneError`, which is not the request's fault.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work: unknown architecture, unresolvable layer split,
    a KV budget too small for the window, a bad knob value."""


class EngineGoneError(RuntimeError):
    """The engine's process died under a request (killed, out of memory, crashed): the request
    itself did not fail, so a replica hands it to the ingress as retryable (docs/design.md §20)."""

"""Errors the worker raises for bad user input (configs, model files, memory budgets).

Every message says what to change; callers at the edges (`deploy/`) show it verbatim.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work: unknown architecture, unresolvable layer split,
    a KV budget too small for the window, a bad knob value."""

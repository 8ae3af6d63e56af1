"""The engine on one device. Never imports ray or HTTP code (docs/design.md §3).

`from worker import Engine, EngineConfig, SamplingParams` is the public entry (docs/design.md §4.1).
The names load lazily, so `worker.cache.events` (read by the router) stays light: no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.config import EngineConfig
    from worker.engine.async_engine import AsyncEngine
    from worker.engine.engine import Engine
    from worker.outputs import EngineStats, Output, StreamDelta
    from worker.sampling_params import SamplingParams

_EXPORTS = {
    "AsyncEngine": "worker.engine.async_engine",
    "Engine": "worker.engine.engine",
    "EngineConfig": "worker.config",
    "EngineStats": "worker.outputs",
    "Output": "worker.outputs",
    "SamplingParams": "worker.sampling_params",
    "StreamDelta": "worker.outputs",
}

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Output",
    "SamplingParams",
    "StreamDelta",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)

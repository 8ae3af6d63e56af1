"""The engine on one device. Never imports ray or HTTP code (docs/design.md §3).

`from worker import Engine, EngineConfig, SamplingParams` is the public entry (docs/design.md §4.1).
The torch-free values the router and the cluster index share with it live in `core`.
"""

from __future__ import annotations

from core.outputs import EngineStats, Output, StreamDelta
from core.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.hosts.async_engine import AsyncEngine

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Output",
    "SamplingParams",
    "StreamDelta",
]

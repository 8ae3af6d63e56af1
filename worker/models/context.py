"""`ForwardContext`: what a model's attention layers need during one forward. The runner builds
one per step (`worker/runner/model_runner.py`, a captured graph's in `cuda_graphs.py`) and the
model hands it down layer by layer: passed explicitly, never a global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from worker.attention.base import AttentionBackend
    from worker.kv.pool import HybridKVPool


@dataclass(frozen=True)
class ForwardContext:
    pool: HybridKVPool
    backend: AttentionBackend
    attn_metadata: Any  # what backend.plan returned for this batch
    out_loc: torch.Tensor  # int64 [T]: full slots of the new tokens, model device
    swa_out_loc: torch.Tensor | None  # int64 [T]: their SWA slots (translated once), or None

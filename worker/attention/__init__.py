"""Attention backends: the interface (`base`), the torch reference and FlashInfer (GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.attention.base import AttentionBackend, AttentionLayer, AttnBatch, KVView

if TYPE_CHECKING:
    import torch

    from worker.kv.pool import HybridKVPool
    from worker.models.spec import ModelSpec

BACKENDS = ("torch", "flashinfer")


def create_backend(
    name: str, pool: HybridKVPool, spec: ModelSpec, device: str | torch.device
) -> AttentionBackend:
    """The backend called `name` ("torch" or "flashinfer"), imported lazily."""
    if name == "torch":
        from worker.attention.torch_backend import TorchBackend

        return TorchBackend(pool)
    if name == "flashinfer":
        from worker.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(pool, spec, device)
    raise ValueError(f"attention_backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "AttentionBackend",
    "AttentionLayer",
    "AttnBatch",
    "KVView",
    "create_backend",
    "BACKENDS",
]

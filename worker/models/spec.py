"""Model spec: what the KV layer needs to know about a hybrid SWA model.

`window` is the one window constant of docs/design.md §1: keys to the *left* of the query
(HF ``sliding_window - 1``). A query at position q on an SWA layer attends keys q-window … q.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# A transformers `PretrainedConfig`: its attributes differ per architecture, so model files read
# them dynamically (hf_config.py validates what the engine relies on).
HFConfig = Any


class LayerKind(enum.Enum):
    FULL = "full"
    SWA = "swa"


@dataclass(frozen=True)
class KindShape:
    """Attention shape of one layer kind (full or SWA)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim
    v_head_dim: int
    has_sinks: bool = False

    def kv_elems_per_token(self) -> int:
        """K+V elements one token occupies in one layer of this kind."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # HF model_type, e.g. "gpt_oss", "gemma3_text", "mimo_v2_flash"
    layer_kinds: tuple[LayerKind, ...]
    window: int | None  # keys to the left (HF sliding_window - 1); None when no layer slides
    full: KindShape
    swa: KindShape
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2/3 scale queries by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if any(k is LayerKind.SWA for k in self.layer_kinds) and self.window is None:
            raise ValueError("a model with SWA layers needs a window")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def num_layers_of(self, kind: LayerKind) -> int:
        return len(self.full_layer_ids if kind is LayerKind.FULL else self.swa_layer_ids)

    @cached_property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.FULL)

    @cached_property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.SWA)

    @property
    def is_hybrid(self) -> bool:
        """Both kinds present: the case the dual pools are for."""
        return bool(self.full_layer_ids) and bool(self.swa_layer_ids)

    @property
    def is_all_swa(self) -> bool:
        return not self.full_layer_ids

    @property
    def has_swa(self) -> bool:
        return bool(self.swa_layer_ids)

    @cached_property
    def layer_index(self) -> tuple[tuple[LayerKind, int], ...]:
        """layer id -> (kind, index among the layers of that kind)."""
        seen = {LayerKind.FULL: 0, LayerKind.SWA: 0}
        out = []
        for kind in self.layer_kinds:
            out.append((kind, seen[kind]))
            seen[kind] += 1
        return tuple(out)

    def shape(self, kind: LayerKind) -> KindShape:
        return self.full if kind is LayerKind.FULL else self.swa

    def kv_bytes_per_token(self, kind: LayerKind, dtype_bytes: int) -> int:
        """Bytes one token's K+V takes in ONE layer of `kind`."""
        return self.shape(kind).kv_elems_per_token() * dtype_bytes

    def kind_bytes_per_token(self, kind: LayerKind, dtype_bytes: int) -> int:
        """Bytes one token's K+V takes over ALL layers of `kind` (one slot of that pool)."""
        return self.kv_bytes_per_token(kind, dtype_bytes) * self.num_layers_of(kind)

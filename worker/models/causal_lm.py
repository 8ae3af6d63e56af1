"""The decoder-only skeleton every architecture fills in: ``model.embed_tokens``,
``model.layers.N``, ``model.norm``, ``lm_head`` (HF's names), one rope per layer kind, and the
final logit transforms (Gemma softcap, Cohere scale).

Models take flat token batches: ``input_ids [T]`` and ``positions [T]`` of all requests'
new tokens concatenated; attention finds each request's keys through the `ForwardContext`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from worker.attention.base import AttentionLayer
from worker.models.rope import CosSin, Rotary
from worker.models.self_attention import SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.compiled import CompiledForward
    from worker.models.context import ForwardContext


class DecoderModel(nn.Module):
    """HF's ``model.`` submodule. Each layer is called as ``layer(hidden, cos_sin, ctx)``."""

    def __init__(
        self,
        embed_tokens: nn.Embedding,
        layers: Sequence[nn.Module],
        norm: nn.Module,
        ropes: dict[LayerKind, Rotary | None],
        layer_kinds: Sequence[LayerKind],
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.ropes = ropes
        self.layer_kinds = tuple(layer_kinds)

    def place_ropes(self, device: torch.device) -> None:
        """Put every rope's frequencies on `device` (after the weights were allocated there)."""
        for rope in {id(r): r for r in self.ropes.values() if r is not None}.values():
            rope.to(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        by_rope: dict[int, CosSin] = {}  # kinds often share one rope: compute it once
        cos_sin: dict[LayerKind, CosSin | None] = {}
        for kind, rope in self.ropes.items():
            if rope is not None and id(rope) not in by_rope:
                by_rope[id(rope)] = rope(positions, h.dtype)
            cos_sin[kind] = by_rope[id(rope)] if rope is not None else None
        for layer, kind in zip(self.layers, self.layer_kinds):
            h = layer(h, cos_sin[kind], ctx)
        return self.norm(h)


class CausalLM(nn.Module):
    """A decoder plus its LM head. Subclasses only assemble (one per architecture file)."""

    # Parameter-name substrings kept in float32 when the model runs in a lower precision, as the
    # HF class does (`_keep_in_fp32_modules`).
    keep_fp32: tuple[str, ...] = ()
    # Checkpoint name prefixes rewritten on load (a multimodal wrapper's language model), and
    # prefixes of tensors this class does not use (its vision tower).
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = ()

    def __init__(
        self,
        spec: ModelSpec,
        model: DecoderModel,
        *,
        tie_word_embeddings: bool,
        final_logit_softcapping: float | None = None,
        logit_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.model = model
        hidden, vocab = model.embed_tokens.embedding_dim, model.embed_tokens.num_embeddings
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight
        self.final_logit_softcapping = final_logit_softcapping
        self.logit_scale = logit_scale
        self.compiled: CompiledForward | None = None  # set by `worker.models.compiled`

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        if self.compiled is not None:
            return self.compiled.forward(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled.logits(hidden)
        return self.logits_eager(hidden)

    def logits_eager(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[AttentionLayer]:
        out = []
        for block in self.model.layers:
            attn = block.self_attn
            assert isinstance(attn, SelfAttention), f"{type(block).__name__}.self_attn"
            out.append(attn.layer)
        return out

    def tie_weights(self) -> None:
        """Re-point the head at the embedding (after `to_empty` or a dtype cast broke the tie)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def attention_layer(
    spec: ModelSpec,
    layer_id: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    scaling: float,
    softcap: float | None = None,
) -> AttentionLayer:
    """Layer `layer_id`'s description: its kind from the spec, its shape from the HF config.

    The runner checks the shape against the spec (the pool is sized from the spec).
    """
    kind, _ = spec.layer_index[layer_id]
    return AttentionLayer(
        layer_id=layer_id,
        kind=kind,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim if v_head_dim is None else v_head_dim,
        scaling=scaling,
        softcap=softcap,
    )


class Architecture(Protocol):
    """A model class as the loader uses it: built from (HF config, spec) on the meta device,
    with the parameter-name substrings it keeps in float32."""

    keep_fp32: tuple[str, ...]

    def __call__(self, config: HFConfig, spec: ModelSpec) -> CausalLM: ...

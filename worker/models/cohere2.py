"""Cohere 2 (HF ``cohere2``): parallel attention + MLP after one bias-free LayerNorm, interleaved
rope on sliding layers only (full layers use no positional encoding), logits times
``logit_scale``, tied head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.models.causal_lm import CausalLM, DecoderModel, attention_layer
from worker.models.layers import BiaslessLayerNorm, GatedMLP
from worker.models.rope import CosSin, Rotary, rope_inv_freq
from worker.models.self_attention import AttnOptions, SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.context import ForwardContext


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        layer = attention_layer(
            spec,
            layer_id,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=d,
            scaling=d**-0.5,
        )
        opts = AttnOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.self_attn = SelfAttention(h, layer, opts)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = BiaslessLayerNorm(h, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        normed = self.input_layernorm(x)
        return x + self.self_attn(normed, cos_sin, ctx) + self.mlp(normed)


class Cohere2ForCausalLM(CausalLM):
    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        rope = Rotary(
            *rope_inv_freq(config.rope_parameters, config.head_dim, config.max_position_embeddings),
            "interleaved",
        )
        model = DecoderModel(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=[Cohere2DecoderLayer(config, spec, i) for i in range(config.num_hidden_layers)],
            norm=BiaslessLayerNorm(config.hidden_size, config.layer_norm_eps),
            ropes={LayerKind.SWA: rope, LayerKind.FULL: None},
            layer_kinds=spec.layer_kinds,
        )
        super().__init__(
            spec,
            model,
            tie_word_embeddings=config.tie_word_embeddings,
            logit_scale=config.logit_scale,
        )

"""Mistral (HF ``mistral``) and Qwen2 (HF ``qwen2``): Llama-shaped decoders with a window.

Mistral slides on every layer when ``sliding_window`` is set (an all-SWA model). Qwen2 slides
only on layers ``>= max_window_layers`` and only with ``use_sliding_window`` (HF's config has
already turned that into ``layer_types``, which the spec follows); it has q/k/v biases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.models.causal_lm import CausalLM, DecoderModel, attention_layer
from worker.models.layers import GatedMLP, RMSNorm
from worker.models.rope import CosSin, Rotary, rope_inv_freq
from worker.models.self_attention import AttnOptions, SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.context import ForwardContext


def _head_dim(config: HFConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaStyleDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, spec: ModelSpec, layer_id: int, opts: AttnOptions) -> None:
        super().__init__()
        h, eps, d = config.hidden_size, config.rms_norm_eps, _head_dim(config)
        layer = attention_layer(
            spec,
            layer_id,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=d,
            scaling=d**-0.5,
        )
        self.self_attn = SelfAttention(h, layer, opts)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _LlamaStyleForCausalLM(CausalLM):
    attn_options = AttnOptions()

    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        rope = Rotary(
            *rope_inv_freq(
                config.rope_parameters, _head_dim(config), config.max_position_embeddings
            ),
            "neox",
        )
        model = DecoderModel(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=[
                LlamaStyleDecoderLayer(config, spec, i, self.attn_options)
                for i in range(config.num_hidden_layers)
            ],
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            ropes={LayerKind.FULL: rope, LayerKind.SWA: rope},
            layer_kinds=spec.layer_kinds,
        )
        super().__init__(spec, model, tie_word_embeddings=config.tie_word_embeddings)


class MistralForCausalLM(_LlamaStyleForCausalLM):
    attn_options = AttnOptions()


class Qwen2ForCausalLM(_LlamaStyleForCausalLM):
    attn_options = AttnOptions(qkv_bias=True)

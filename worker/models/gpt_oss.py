"""GPT-OSS (HF ``gpt_oss``): alternating sliding/full layers, attention sinks on every layer,
YaRN rope, a top-k softmax MoE with clamped SwiGLU. Mirrors ``GptOssForCausalLM``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.models.causal_lm import CausalLM, DecoderModel, attention_layer
from worker.models.layers import RMSNorm
from worker.models.moe import GptOssMoE
from worker.models.rope import CosSin, Rotary, rope_inv_freq
from worker.models.self_attention import AttnOptions, SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.context import ForwardContext


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        layer = attention_layer(
            spec,
            layer_id,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            scaling=config.head_dim**-0.5,
        )
        opts = AttnOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, sinks_name="sinks"
        )
        self.self_attn = SelfAttention(h, layer, opts)
        self.mlp = GptOssMoE(
            h,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.swiglu_alpha,
            config.swiglu_limit,
        )
        self.input_layernorm = RMSNorm(h, eps, "gpt_oss")
        self.post_attention_layernorm = RMSNorm(h, eps, "gpt_oss")

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(CausalLM):
    keep_fp32 = ("input_layernorm", "post_attention_layernorm", "model.norm")

    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        rope = Rotary(
            *rope_inv_freq(config.rope_parameters, config.head_dim, config.max_position_embeddings),
            "neox",
        )
        model = DecoderModel(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=[GptOssDecoderLayer(config, spec, i) for i in range(config.num_hidden_layers)],
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps, "gpt_oss"),
            ropes={LayerKind.FULL: rope, LayerKind.SWA: rope},
            layer_kinds=spec.layer_kinds,
        )
        super().__init__(spec, model, tie_word_embeddings=config.tie_word_embeddings)

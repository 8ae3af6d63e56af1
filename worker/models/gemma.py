"""Gemma 2 (HF ``gemma2``) and Gemma 3 text (HF ``gemma3_text``).

Shared: embeddings scaled by ``sqrt(hidden)``, RMSNorm with ``(1 + w)``, four norms per layer
(pre/post attention, pre/post MLP), query scale ``query_pre_attn_scalar ** -0.5``, GeLU-tanh MLP,
tied head, optional final logit softcap.
Gemma 2 adds a tanh softcap on attention logits. Gemma 3 adds q/k RMSNorm per head and a
separate rope per layer kind (local base for sliding layers, global base and scaling for full).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.models.causal_lm import CausalLM, DecoderModel, attention_layer
from worker.models.layers import GatedMLP, RMSNorm, ScaledEmbedding
from worker.models.rope import CosSin, Rotary, rope_inv_freq
from worker.models.self_attention import AttnOptions, SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.context import ForwardContext

_HF_LAYER_TYPE = {LayerKind.FULL: "full_attention", LayerKind.SWA: "sliding_attention"}


def _head_dim(config: HFConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, spec: ModelSpec, layer_id: int, *, gemma3: bool) -> None:
        super().__init__()
        h, eps, d = config.hidden_size, config.rms_norm_eps, _head_dim(config)
        layer = attention_layer(
            spec,
            layer_id,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=d,
            scaling=config.query_pre_attn_scalar**-0.5,
            # NOTE: HF's Gemma 3 attention never passes the softcap to the kernel, even if the
            # config sets attn_logit_softcapping; Gemma 2 always does.
            softcap=None if gemma3 else config.attn_logit_softcapping,
        )
        opts = AttnOptions(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm_eps=eps if gemma3 else None,
        )
        self.self_attn = SelfAttention(h, layer, opts)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps, "gemma")
        self.post_attention_layernorm = RMSNorm(h, eps, "gemma")
        self.pre_feedforward_layernorm = RMSNorm(h, eps, "gemma")
        self.post_feedforward_layernorm = RMSNorm(h, eps, "gemma")

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _ropes(config: HFConfig, spec: ModelSpec, gemma3: bool) -> dict[LayerKind, Rotary | None]:
    d, max_pos = _head_dim(config), config.max_position_embeddings
    if not gemma3:
        rope = Rotary(*rope_inv_freq(config.rope_parameters, d, max_pos), "neox")
        return {LayerKind.FULL: rope, LayerKind.SWA: rope}
    return {
        kind: Rotary(
            *rope_inv_freq(config.rope_parameters[_HF_LAYER_TYPE[kind]], d, max_pos), "neox"
        )
        for kind in set(spec.layer_kinds)
    }


class _GemmaForCausalLM(CausalLM):
    gemma3 = False

    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError(
                "use_bidirectional_attention=True (an encoder variant) is not supported"
            )
        h = config.hidden_size
        model = DecoderModel(
            embed_tokens=ScaledEmbedding(config.vocab_size, h, h**0.5),
            layers=[
                GemmaDecoderLayer(config, spec, i, gemma3=self.gemma3)
                for i in range(config.num_hidden_layers)
            ],
            norm=RMSNorm(h, config.rms_norm_eps, "gemma"),
            ropes=_ropes(config, spec, self.gemma3),
            layer_kinds=spec.layer_kinds,
        )
        super().__init__(
            spec,
            model,
            tie_word_embeddings=config.tie_word_embeddings,
            final_logit_softcapping=config.final_logit_softcapping,
        )


class Gemma2ForCausalLM(_GemmaForCausalLM):
    gemma3 = False


class Gemma3ForCausalLM(_GemmaForCausalLM):
    gemma3 = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model inside HF's multimodal Gemma 3 (model_type ``gemma3``): text only.

    Built from ``config.text_config``; its checkpoint nests the LM under ``language_model.``
    (``save_pretrained``'s layout) or ``model.language_model.``; the vision tower is skipped.
    """

    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )
    ignored_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        super().__init__(getattr(config, "text_config", None) or config, spec)

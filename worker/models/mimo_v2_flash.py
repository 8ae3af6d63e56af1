"""MiMo-V2-Flash (HF ``mimo_v2_flash``): the hardest hybrid case.

- SWA layers have twice the KV heads of full layers and attention sinks; full layers have none;
- ``v_head_dim`` differs from the q/k ``head_dim``, and V is scaled by ``attention_value_scale``
  before it is cached;
- partial rotary (``partial_rotary_factor``) with a different rope base per layer kind;
- layer 0 (by default) is a dense MLP, the rest a sigmoid-routed MoE.

Parameter names follow the checkpoint layout that ``save_pretrained`` writes (per-expert
``mlp.experts.N.*`` and ``self_attn.attention_sink_bias``), which HF converts on load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.models.causal_lm import CausalLM, DecoderModel, attention_layer
from worker.models.layers import GatedMLP, RMSNorm
from worker.models.moe import MiMoMoE
from worker.models.rope import CosSin, Rotary, rope_inv_freq
from worker.models.self_attention import AttnOptions, SelfAttention
from worker.models.spec import HFConfig, LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.models.context import ForwardContext

_HF_LAYER_TYPE = {LayerKind.FULL: "full_attention", LayerKind.SWA: "sliding_attention"}


def _rope(config: HFConfig, kind: LayerKind) -> Rotary:
    params = dict(config.rope_parameters[_HF_LAYER_TYPE[kind]])
    if params.get("rope_type", "default") == "default":
        # HF's MiMo default rope assumes 0.334 when the factor is missing (generic types: 1.0).
        params.setdefault("partial_rotary_factor", 0.334)
    return Rotary(*rope_inv_freq(params, config.head_dim, config.max_position_embeddings), "neox")


class MiMoV2FlashDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        is_swa = spec.layer_kinds[layer_id] is LayerKind.SWA
        layer = attention_layer(
            spec,
            layer_id,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads * (2 if is_swa else 1),
            head_dim=config.head_dim,
            v_head_dim=config.v_head_dim,
            scaling=config.head_dim**-0.5,
        )
        scale = config.attention_value_scale
        opts = AttnOptions(
            qkv_bias=config.attention_bias,
            value_scale=1.0 if scale is None else scale,
            sinks_name="attention_sink_bias" if is_swa else None,
        )
        self.self_attn = SelfAttention(h, layer, opts)
        if config.mlp_layer_types[layer_id] == "sparse":
            self.mlp: nn.Module = MiMoMoE(config)
        else:
            self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class MiMoV2FlashForCausalLM(CausalLM):
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias")

    def __init__(self, config: HFConfig, spec: ModelSpec) -> None:
        kinds = set(spec.layer_kinds)
        model = DecoderModel(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=[
                MiMoV2FlashDecoderLayer(config, spec, i) for i in range(config.num_hidden_layers)
            ],
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            ropes={kind: _rope(config, kind) for kind in kinds},
            layer_kinds=spec.layer_kinds,
        )
        super().__init__(spec, model, tie_word_embeddings=config.tie_word_embeddings)

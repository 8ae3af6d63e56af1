"""The self-attention block shared by every architecture: projections, optional q/k norm, rope,
value scale, sinks, then `PagedAttention` (pool write + backend) and the output projection.

Architectures differ only in options (`AttnOptions`), so one class serves all of them with HF's
parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm`` and the
sinks under the checkpoint's name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.attention.base import AttentionLayer
from worker.models.layers import NormStyle, PagedAttention, RMSNorm
from worker.models.rope import CosSin, apply_rope

if TYPE_CHECKING:
    from worker.models.context import ForwardContext


@dataclass(frozen=True)
class AttnOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None  # Gemma 3: RMSNorm over each head of q and k
    qk_norm_style: NormStyle = "gemma"
    value_scale: float = 1.0  # MiMo scales V before it is cached
    sinks_name: str | None = (
        None  # parameter holding per-head sinks: "sinks" or "attention_sink_bias"
    )


class SelfAttention(nn.Module):
    # `pack_linears` may pack q/k/v as one (`qkv_proj`; the three become None).
    FUSED_LINEARS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),)

    def __init__(self, hidden: int, layer: AttentionLayer, opts: AttnOptions) -> None:
        super().__init__()
        self.layer = layer
        self.opts = opts
        hq, hkv, d, dv = layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        self.q_proj = nn.Linear(hidden, hq * d, bias=opts.qkv_bias)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=opts.qkv_bias)
        self.v_proj = nn.Linear(hidden, hkv * dv, bias=opts.qkv_bias)
        self.o_proj = nn.Linear(hq * dv, hidden, bias=opts.o_bias)
        self.qkv_proj: nn.Module | None = None
        if opts.qk_norm_eps is not None:
            self.q_norm = RMSNorm(d, opts.qk_norm_eps, opts.qk_norm_style)
            self.k_norm = RMSNorm(d, opts.qk_norm_eps, opts.qk_norm_style)
        if opts.sinks_name is not None:
            self.register_parameter(opts.sinks_name, nn.Parameter(torch.zeros(hq)))
        self.attn = PagedAttention(layer)

    def sink_logits(self) -> torch.Tensor | None:
        name = self.opts.sinks_name
        return None if name is None else getattr(self, name)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        layer = self.layer
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, layer.num_q_heads, layer.head_dim)
        k = k.view(t, layer.num_kv_heads, layer.head_dim)
        v = v.view(t, layer.num_kv_heads, layer.v_head_dim)
        if self.opts.value_scale != 1.0:
            v = v * self.opts.value_scale
        if self.opts.qk_norm_eps is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:  # Cohere 2 full layers have no positional encoding
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        out = self.attn(q, k, v, ctx, self.sink_logits())
        return self.o_proj(out.reshape(t, layer.num_q_heads * layer.v_head_dim))

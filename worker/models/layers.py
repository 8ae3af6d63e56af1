"""Shared layers: norms, gated MLP, activations, scaled embedding and the paged attention call.

Each class reproduces the arithmetic of its Hugging Face counterpart (transformers 5.24) in the
same order, so float32 outputs match the eager reference to rounding. Parameter names equal HF's
so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.base import AttentionLayer

if TYPE_CHECKING:
    from worker.models.context import ForwardContext

NormStyle = Literal["llama", "gpt_oss", "gemma"]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The HF ``hidden_act`` / ``hidden_activation`` names the supported models use."""
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": gelu_tanh,
        "gelu_new": gelu_tanh,
    }
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(table)}")
    return table[name]


# 2 * sqrt(2 / pi): 0.5 * (1 + tanh(u)) == sigmoid(2u)
_GELU_2K = 1.5957691216057308


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``F.gelu(x, approximate="tanh")``).

    Under `torch.compile` it is written as ``x * sigmoid(2u)``, the same function: inductor's CPU
    code vectorises `tanh` through an accurate but slow routine, and the sigmoid form (one `exp`)
    ran 3.2x faster on a 256 x 2,048 gated MLP (670 -> 205 us on one thread; 12 such calls in a
    256-token prefill step of the 46M Gemma-3), within 1e-6 of it."""
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(_GELU_2K * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


class RMSNorm(nn.Module):
    """RMSNorm in the three HF flavours.

    - ``llama``: ``w * x_normed.to(dtype)`` (Mistral, Qwen2, MiMo);
    - ``gpt_oss``: ``(w * x_normed).to(dtype)``;
    - ``gemma``: ``x_normed * (1 + w)`` in float32, weight initialised to 0.
    """

    def __init__(self, dim: int, eps: float, style: NormStyle = "llama") -> None:
        super().__init__()
        init = torch.zeros(dim) if style == "gemma" else torch.ones(dim)
        self.weight = nn.Parameter(init)
        self.eps = eps
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.compiler.is_compiling():
            # One fused op, the same arithmetic in float32 (`F.rms_norm`, ~1.6x faster than the
            # five ops below on a CPU, where a Gemma decode step runs six norms a layer).
            return F.rms_norm(x, (x.shape[-1],), self._scale(), self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (normed * (1.0 + self.weight.float())).type_as(x)
        if self.style == "gpt_oss":
            return (self.weight * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


    def _scale(self) -> torch.Tensor:
        """The float32 factor the normed rows are multiplied by: `w`, or Gemma's `1 + w`,
        computed again only when the weight changed (loading writes it in place)."""
        w = self.weight
        key = (w._version, w.data_ptr())
        if getattr(self, "_scale_key", None) != key:
            with torch.no_grad():
                self._scale_cache = (1.0 + w.float()) if self.style == "gemma" else w.float()
            self._scale_key = key
        return self._scale_cache


class BiaslessLayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, weight only, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF's ``gate_proj``/``up_proj``/``down_proj`` names."""

    # `pack_linears` may pack gate and up as one (`gate_up_proj`; the two become None).
    FUSED_LINEARS = (("gate_up_proj", ("gate_proj", "up_proj")),)

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None
        self.act_fn = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


def rounded_scale(scale: float) -> dict[torch.dtype, float]:
    """`scale` rounded to each weight dtype, as HF does (a float32 scalar cast to the weight's
    dtype; rounding the Python float directly could differ by one ulp in bfloat16). Python
    floats, computed once: a tensor made per forward would be a host tensor copied to the
    device on every call (a sync, and illegal in a CUDA-graph capture)."""
    f32 = torch.tensor(scale, dtype=torch.float32, device="cpu")
    return {dt: f32.to(dt).item() for dt in (torch.float32, torch.bfloat16, torch.float16)}


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: the lookup times ``sqrt(hidden)`` rounded to the weight dtype."""

    def __init__(self, vocab: int, hidden: int, scale: float) -> None:
        super().__init__(vocab, hidden)
        self.scale = scale
        self.scales = rounded_scale(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # NOTE: a Python float times the weight-dtype tensor is the product HF takes with its
        # 0-dim tensor of that dtype (the value is exact in the dtype; the math in float32).
        return super().forward(ids) * self.scales[self.weight.dtype]


class PagedAttention(nn.Module):
    """Writes this layer's new K/V into the pool, then attends through the backend.

    NOTE: the write comes first: every new token attends to itself and to the new tokens before
    it, which the backend reads back from the pool.
    """

    def __init__(self, layer: AttentionLayer) -> None:
        super().__init__()
        self.layer = layer
        # Under torch.compile: one opaque custom op, the context from the compiled call's slot
        # (`worker.models.compiled`); `ctx` is then None.
        self.opaque = False

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        ctx: ForwardContext | None,
        sinks: torch.Tensor | None = None,  # [Hq] per-head logit added to the softmax denominator
    ) -> torch.Tensor:
        if self.opaque:
            return torch.ops.swaserve.paged_attention(q, k, v, sinks, self.layer.layer_id)
        assert ctx is not None, "an eager forward passes its ForwardContext"
        ctx.pool.set_kv(self.layer.layer_id, k, v, ctx.out_loc, ctx.swa_out_loc)
        return ctx.backend.forward(self.layer, q, ctx.attn_metadata, sinks)  # [T, Hq, Dv]

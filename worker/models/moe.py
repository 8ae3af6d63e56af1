"""Mixture-of-experts blocks: GPT-OSS (softmax over top-k router logits, clamped SwiGLU with
biases, fused expert tensors) and MiMo-V2-Flash (sigmoid scores with a correction bias, grouped
top-k, one gated MLP per expert as the checkpoint stores them).

Both run each expert that received tokens on its rows (tokens sorted by expert once): exact
FLOPs, the same arithmetic as HF's per-expert loop, and few ops per step for the small expert
counts this project runs on CPU. Under tensor parallelism each rank holds a contiguous range of
whole experts (`ExpertShard`) and its partial sum is all-reduced (docs/design.md §17.2).

NOTE: the per-expert loop needs the token counts on the host (one sync), which `torch.compile`
cannot trace: a graph break there made every decoder layer a frame of its own, recompiled per
layer, and after warm-up `skip_guard_eval_unsafe` turns such a recompile into an error. Under
compile a block is therefore one opaque operator, ``swaserve::moe(x, index)`` (`MoEBlock`; the
module found by index in a weak registry, as `PackedLinear` does), like attention (§19).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.layers import GatedMLP
from worker.models.opaque_ops import define_opaque_op
from worker.models.spec import HFConfig

# Every MoE block of the process, by index, for the opaque op (weak: a freed model frees them).
_REGISTRY: list[weakref.ref[MoEBlock]] = []


@dataclass(frozen=True)
class ExpertShard:
    """The experts a module holds (all of them, or one rank's range), and how its partial sum
    becomes the layer's output (None: it already is)."""

    experts: range
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.reduce is None else self.reduce(out)


def _combine(
    x: torch.Tensor,
    top_idx: torch.Tensor,  # [T, k]
    top_w: torch.Tensor,  # [T, k]
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],  # (expert id, rows [n, H]) -> [n, H]
    experts: range,  # the expert ids held here; pairs routed elsewhere contribute nothing
) -> torch.Tensor:
    """Sum over each token's k experts (those in `experts`) of ``expert(x) * weight``.

    The (token, slot) pairs are sorted by expert once (stable, so tokens stay ascending within
    an expert), each expert runs on its contiguous slice, and ONE ``index_add_`` scatters all
    results: a token's row receives its experts' outputs in ascending expert order, the same
    additions as one ``index_add_`` per expert (HF), with a handful of ops instead of a dozen per
    expert (the cost that dominates small batches). A range of experts is a contiguous run of
    the sorted pairs.
    """
    k = top_idx.shape[1]
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.stop).tolist()  # the one host sync
    lo = sum(counts[: experts.start])
    hi = lo + sum(counts[experts.start : experts.stop])
    out = torch.zeros_like(x)
    if hi == lo:
        return out
    order = order[lo:hi]
    token = torch.div(order, k, rounding_mode="floor")
    rows = x.index_select(0, token)
    ys, start = [], 0
    for e in experts:
        n = counts[e]
        if n:
            ys.append(expert_fn(e, rows[start : start + n]))
            start += n
    y = torch.cat(ys) * top_w.reshape(-1).index_select(0, order)[:, None]
    return out.index_add_(0, token, y.to(out.dtype))


class MoEBlock(nn.Module):
    """A mixture-of-experts block: `mix` routes and combines; under `torch.compile` it is the
    opaque ``swaserve::moe`` op (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = len(_REGISTRY)
        _REGISTRY.append(weakref.ref(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.swaserve.moe(x, self.index)
        return self.mix(x)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``, a fresh tensor (the opaque op's contract)."""
        raise NotImplementedError


def _moe(x: torch.Tensor, index: int) -> torch.Tensor:
    block = _REGISTRY[index]()
    assert block is not None, f"MoE block {index} was freed"
    return block.mix(x)


def _moe_fake(x: torch.Tensor, index: int) -> torch.Tensor:
    return torch.empty_like(x)


define_opaque_op("moe", "(Tensor x, int index) -> Tensor", _moe, _moe_fake)


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top_val, top_idx = torch.topk(logits, self.top_k, dim=-1)
        return top_idx, torch.softmax(top_val, dim=1, dtype=top_val.dtype)


class GptOssExperts(nn.Module):
    """Fused expert weights, gate/up interleaved along the last dim (HF layout)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.alpha = alpha
        self.limit = limit

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s ``[in, out]`` matrix `name` (`Mxfp4Experts` dequantizes it here)."""
        w: torch.Tensor = getattr(self, name)[e]
        return w

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.weight("gate_up_proj", e, x.dtype) + self.gate_up_proj_bias[e]
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.weight("down_proj", e, x.dtype) + self.down_proj_bias[e]


class GptOssMoE(MoEBlock):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.router = GptOssRouter(hidden, num_experts, top_k)
        self.experts = GptOssExperts(hidden, intermediate, num_experts, alpha, limit)
        self.shard = ExpertShard(range(num_experts))  # the fused tensors hold these, in order

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        top_idx, top_w = self.router(x)
        # Experts kept MXFP4 on a GPU with FlashInfer's fused kernel (`quant.mxfp4_kernel`).
        fused = getattr(self.experts, "fused", None)
        if fused is not None:
            total = self.router.weight.shape[0]
            return self.shard.finish(fused(x, top_idx, top_w, self.shard.experts, total))
        first = self.shard.experts.start

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return self.experts.expert(e - first, rows)

        return self.shard.finish(_combine(x, top_idx, top_w, expert, self.shard.experts))


class MiMoRouter(nn.Module):
    """Sigmoid scores; the correction bias only steers the choice, not the weights."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
        norm_topk_prob: bool, routed_scaling_factor: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor  # a buffer: loaded from the checkpoint
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
        )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = choice.view(-1, self.n_group, num_experts // self.n_group)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        top_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_idx)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_idx, top_w * self.routed_scaling_factor


class MiMoMoE(MoEBlock):
    """``mlp.gate`` (router) and ``mlp.experts.N.{gate,up,down}_proj`` (checkpoint layout)."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate = MiMoRouter(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
            for _ in range(config.n_routed_experts)
        )
        # Under TP, experts outside the range are empty modules (their index stays their name).
        self.shard = ExpertShard(range(config.n_routed_experts))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        top_idx, top_w = self.gate(x)
        out = _combine(x, top_idx, top_w, lambda e, rows: self.experts[e](rows), self.shard.experts)
        return self.shard.finish(out)

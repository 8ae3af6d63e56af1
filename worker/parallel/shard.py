"""Cut a model into one rank's shard (docs/design.md §17.2), on the meta device before any weight
is allocated, and say which slice of each checkpoint tensor the loader copies (`ShardPlan`).

| module | split over the N ranks |
|---|---|
| `q_proj` / `o_proj` | query heads: column- / row-parallel; sinks follow the query heads |
| `k_proj`, `v_proj` | KV heads of the layer's kind: sharded when N divides them, else each head replicated on N / heads ranks (`kv_heads_of_rank`) |
| dense MLP | intermediate: gate/up column-, down row-parallel |
| MoE | expert parallel: a contiguous range of whole experts per rank (experts kept quantized too: MXFP4 blocks and scales, FP8 expert linears); the router is replicated; the partial sums are all-reduced |
| embedding, LM head | vocab rows (padded to a multiple of N); logits gathered at rank 0 |
| norms, rope, router | replicated |

The model files stay unchanged: the modules are replaced in place under their names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from worker.errors import ConfigError
from worker.models.causal_lm import CausalLM
from worker.models.layers import GatedMLP, ScaledEmbedding
from worker.models.moe import ExpertShard, GptOssMoE, MiMoMoE
from worker.models.self_attention import SelfAttention
from worker.models.spec import KindShape, ModelSpec
from worker.parallel.group import TPGroup
from worker.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Slice,
    VocabParallelEmbedding,
    VocabParallelHead,
)


@dataclass
class ShardPlan:
    """What the loader does differently for one rank: slice these parameters; skip the
    checkpoint tensors under `foreign` prefixes (experts other ranks hold)."""

    slices: dict[str, Slice] = field(default_factory=dict)
    foreign: list[str] = field(default_factory=list)

    def held_elsewhere(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.foreign)


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads `rank` holds: its 1/N of them, or the one head it shares with N/heads ranks.

    Either way the rank's query heads (its 1/N, contiguous) read exactly these KV heads.
    """
    if num_kv_heads % size == 0:
        n = num_kv_heads // size
        return range(rank * n, (rank + 1) * n)
    if size % num_kv_heads == 0:
        head = rank // (size // num_kv_heads)
        return range(head, head + 1)
    raise ConfigError(
        f"{num_kv_heads} KV heads can be neither split over nor replicated on "
        f"tensor_parallel_size={size}: use a size that divides the KV heads or a multiple of them"
    )


def shard_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """One rank's spec: the same layers, window and vocab; its share of each kind's heads (the
    pools are sized in tokens from the full spec's plan and in bytes from this one)."""
    if size == 1:
        return spec

    def shape(s: KindShape) -> KindShape:
        if s.num_q_heads % size:
            raise ConfigError(
                f"{s.num_q_heads} attention heads do not split over tensor_parallel_size={size}; "
                "use a size that divides the head count"
            )
        kv = len(kv_heads_of_rank(s.num_kv_heads, size, 0))
        return dataclasses.replace(s, num_q_heads=s.num_q_heads // size, num_kv_heads=kv)

    return dataclasses.replace(spec, full=shape(spec.full), swa=shape(spec.swa))


def _split(n: int, size: int, what: str) -> int:
    if n % size:
        raise ConfigError(
            f"{what} ({n}) does not split over tensor_parallel_size={size}; use a size that "
            "divides it"
        )
    return n // size


class _Sharder:
    def __init__(self, group: TPGroup) -> None:
        self.group, self.size, self.rank = group, group.size, group.rank
        self.plan = ShardPlan()

    def _slice(self, name: str, dim: int, start: int, length: int, full: int) -> None:
        self.plan.slices[name] = Slice(dim, start, length, full)

    def attention(self, name: str, attn: SelfAttention) -> None:
        layer, r = attn.layer, self.rank
        hq = _split(layer.num_q_heads, self.size, f"{name}: query heads")
        kv = kv_heads_of_rank(layer.num_kv_heads, self.size, r)
        d, dv = layer.head_dim, layer.v_head_dim
        for proj, start, n, per in (
            ("q_proj", r * hq, hq, d),
            ("k_proj", kv.start, len(kv), d),
            ("v_proj", kv.start, len(kv), dv),
        ):
            orig = getattr(attn, proj)
            setattr(attn, proj, ColumnParallelLinear(orig, n * per))
            full = orig.out_features
            self._slice(f"{name}.{proj}.weight", 0, start * per, n * per, full)
            if orig.bias is not None:
                self._slice(f"{name}.{proj}.bias", 0, start * per, n * per, full)
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(o, hq * dv, self.group)  # type: ignore[assignment]
        self._slice(f"{name}.o_proj.weight", 1, r * hq * dv, hq * dv, o.in_features)
        sinks = attn.opts.sinks_name
        if sinks is not None:
            orig_sinks = getattr(attn, sinks)
            setattr(attn, sinks, nn.Parameter(orig_sinks.new_empty(hq)))
            self._slice(f"{name}.{sinks}", 0, r * hq, hq, layer.num_q_heads)
        attn.layer = dataclasses.replace(layer, num_q_heads=hq, num_kv_heads=len(kv))
        attn.attn.layer = attn.layer

    def mlp(self, name: str, mlp: GatedMLP) -> None:
        full = mlp.gate_proj.out_features
        n = _split(full, self.size, f"{name}: intermediate size")
        for proj in ("gate_proj", "up_proj"):
            setattr(mlp, proj, ColumnParallelLinear(getattr(mlp, proj), n))
            self._slice(f"{name}.{proj}.weight", 0, self.rank * n, n, full)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, n, self.group)  # type: ignore[assignment]
        self._slice(f"{name}.down_proj.weight", 1, self.rank * n, n, full)

    def _experts(self, name: str, total: int) -> range:
        n = _split(total, self.size, f"{name}: experts")
        return range(self.rank * n, (self.rank + 1) * n)

    def gpt_oss_moe(self, name: str, moe: GptOssMoE) -> None:
        mine = self._experts(name, moe.shard.experts.stop)
        for pname, p in list(moe.experts.named_parameters(recurse=False)):
            setattr(moe.experts, pname, nn.Parameter(p.new_empty(len(mine), *p.shape[1:])))
            self._slice(f"{name}.experts.{pname}", 0, mine.start, len(mine), p.shape[0])
        # Experts kept MXFP4 (`Mxfp4Experts`): the packed blocks and scales, experts first too.
        for bname, b in list(moe.experts.named_buffers(recurse=False)):
            moe.experts.register_buffer(bname, b.new_empty(len(mine), *b.shape[1:]))
            self._slice(f"{name}.experts.{bname}", 0, mine.start, len(mine), b.shape[0])
        moe.shard = ExpertShard(mine, self.group.all_reduce)

    def mimo_moe(self, name: str, moe: MiMoMoE) -> None:
        mine = self._experts(name, len(moe.experts))
        for e in range(len(moe.experts)):
            if e not in mine:
                moe.experts[e] = nn.Module()  # no parameters: the expert lives on another rank
                self.plan.foreign.append(f"{name}.experts.{e}.")
        moe.shard = ExpertShard(mine, self.group.all_reduce)

    def vocab(self, model: CausalLM) -> None:
        emb = model.model.embed_tokens
        vocab = emb.num_embeddings
        rows = -(-vocab // self.size)  # padded: every rank holds the same number of rows
        start = self.rank * rows
        length = max(0, min(rows, vocab - start))
        scale = emb.scale if isinstance(emb, ScaledEmbedding) else None
        model.model.embed_tokens = VocabParallelEmbedding(emb, start, rows, self.group, scale)  # type: ignore[assignment]
        self._slice("model.embed_tokens.weight", 0, start, length, vocab)
        model.lm_head = VocabParallelHead(model.lm_head, rows)  # type: ignore[assignment]
        self._slice("lm_head.weight", 0, start, length, vocab)


def shard_model(model: CausalLM, group: TPGroup) -> ShardPlan:
    """Replace `model`'s modules by this rank's shards (meta device: nothing is allocated) and
    return the loader's plan. Raises ConfigError naming a size that does not split."""
    sharder = _Sharder(group)
    whole: set[str] = set()  # experts: sharded as whole modules, never inside
    for name, module in list(model.named_modules()):
        if isinstance(module, SelfAttention):
            sharder.attention(name, module)
        elif isinstance(module, GptOssMoE):
            sharder.gpt_oss_moe(name, module)
        elif isinstance(module, MiMoMoE):
            whole.update(f"{name}.experts.{e}" for e in range(len(module.experts)))
            sharder.mimo_moe(name, module)
        elif isinstance(module, GatedMLP) and name not in whole:
            sharder.mlp(name, module)
    sharder.vocab(model)
    return sharder.plan

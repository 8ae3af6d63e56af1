"""The reference backend: gather the keys each request may see, then an explicit masked softmax.

Runs anywhere torch runs (CPU tests, GPU cross-checks). Per layer kind `plan` builds:

- one padded group for all decode rows (one query per request), vectorised;
- one entry per extend request (prefill chunk), attended request by request.

Scores follow the HF eager order: ``(q @ k^T) * scaling`` → tanh softcap → mask → softmax in
float32, with a sink column appended per head when the layer has sinks (its probability is
dropped after the softmax, so it only enlarges the denominator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttnBatch,
    KVView,
)
from worker.spec import LayerKind

if TYPE_CHECKING:
    from worker.mem.pool import HybridKVPool


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # int64 [Bd]: query rows of the decode requests
    kv_idx: torch.Tensor  # int64 [Bd, L]: slots, padded with the dummy slot 0
    mask: torch.Tensor  # bool [Bd, 1, L]: key visible to the query


@dataclass(frozen=True)
class _Extend:
    start: int  # first query row
    end: int
    kv_idx: torch.Tensor  # int64 [L]
    mask: torch.Tensor  # bool [Q, L]


@dataclass(frozen=True)
class _KindMeta:
    decode: _DecodeGroup | None
    extends: tuple[_Extend, ...]


@dataclass(frozen=True)
class TorchMetadata:
    per_kind: dict[LayerKind, _KindMeta]
    num_tokens: int


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility of keys ``k_pos [..., L]`` to queries ``q_pos [..., Q, 1]``."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos >= q_pos - window
    return ok


def _kv_offsets(batch: AttnBatch, view: KVView) -> list[int]:
    """Host copy of the view's indptr (no device sync): key counts follow from the positions."""
    out = [0]
    for seq, start in zip(batch.seq_lens, view.kv_starts):
        out.append(out[-1] + seq - start)
    return out


def _query_offsets(batch: AttnBatch) -> list[int]:
    out, acc = [], 0
    for q in batch.q_lens:
        out.append(acc)
        acc += q
    return out


def _decode_group(
    batch: AttnBatch, view: KVView, reqs: list[int], window: int | None, kv_off: list[int]
) -> _DecodeGroup:
    dev = view.indices.device
    lens_host = [kv_off[i + 1] - kv_off[i] for i in reqs]
    starts = torch.tensor([kv_off[i] for i in reqs], device=dev)
    lens = torch.tensor(lens_host, device=dev)
    offs = torch.arange(max(lens_host), device=dev)
    valid = offs[None, :] < lens[:, None]
    flat = torch.where(valid, starts[:, None] + offs[None, :], 0)
    kv_idx = torch.where(valid, view.indices[flat], 0)
    kv_start = torch.tensor([view.kv_starts[i] for i in reqs], device=dev)
    q_pos = torch.tensor([batch.seq_lens[i] - 1 for i in reqs], device=dev)
    mask = valid & _visible(q_pos[:, None], kv_start[:, None] + offs[None, :], window)
    q_off = _query_offsets(batch)
    rows = torch.tensor([q_off[i] for i in reqs], dtype=torch.int64, device=dev)
    return _DecodeGroup(rows=rows, kv_idx=kv_idx, mask=mask[:, None, :])


def _extend(
    batch: AttnBatch, view: KVView, i: int, window: int | None, start: int, kv_off: list[int]
) -> _Extend:
    dev = view.indices.device
    lo, hi = kv_off[i], kv_off[i + 1]
    q_len, seq = batch.q_lens[i], batch.seq_lens[i]
    q_pos = torch.arange(seq - q_len, seq, device=dev)
    k_pos = torch.arange(view.kv_starts[i], view.kv_starts[i] + hi - lo, device=dev)
    mask = _visible(q_pos[:, None], k_pos[None, :], window)
    return _Extend(start=start, end=start + q_len, kv_idx=view.indices[lo:hi], mask=mask)


def _plan_kind(batch: AttnBatch, view: KVView, window: int | None) -> _KindMeta:
    q_off, kv_off = _query_offsets(batch), _kv_offsets(batch, view)
    decodes = [i for i, q in enumerate(batch.q_lens) if q == 1]
    extends = tuple(
        _extend(batch, view, i, window, q_off[i], kv_off)
        for i, q in enumerate(batch.q_lens)
        if q > 1
    )
    group = _decode_group(batch, view, decodes, window, kv_off) if decodes else None
    return _KindMeta(decode=group, extends=extends)


def masked_attention(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, Dv]
    mask: torch.Tensor,  # bool [B, Q, L]
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [Hq]
) -> torch.Tensor:
    """Explicit GQA attention; query head h uses KV head ``h // (Hq // Hkv)`` (HF `repeat_kv`)."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scores = torch.einsum("bqhgd,blhd->bhgql", q.view(b, nq, hkv, g, d), k) * scaling
    scores = scores.float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgql,blhd->bqhgd", probs.to(v.dtype), v)
    return out.reshape(b, nq, hq, v.shape[-1])


class TorchBackend(AttentionBackend):
    """Reference attention over a `HybridKVPool` (any device)."""

    name = "torch"

    def __init__(self, pool: HybridKVPool) -> None:
        self.pool = pool

    def plan(self, batch: AttnBatch) -> TorchMetadata:
        per_kind = {}
        for kind, view in batch.kv.items():
            window = batch.window if kind is LayerKind.SWA else None
            per_kind[kind] = _plan_kind(batch, view, window)
        return TorchMetadata(per_kind=per_kind, num_tokens=int(batch.positions.numel()))

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        metadata: TorchMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = metadata.per_kind[layer.kind]
        k_buf, v_buf = self.pool.kv_buffers(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_q_heads, layer.v_head_dim)
        args = (layer.scaling, layer.softcap, sinks)
        if meta.decode is not None:
            grp = meta.decode
            res = masked_attention(
                q[grp.rows][:, None], k_buf[grp.kv_idx], v_buf[grp.kv_idx], grp.mask, *args
            )
            out[grp.rows] = res[:, 0]
        for ext in meta.extends:
            res = masked_attention(
                q[None, ext.start : ext.end],
                k_buf[ext.kv_idx][None],
                v_buf[ext.kv_idx][None],
                ext.mask[None],
                *args,
            )
            out[ext.start : ext.end] = res[0]
        return out


__all__ = ["TorchBackend", "TorchMetadata", "masked_attention"]

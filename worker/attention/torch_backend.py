"""The reference backend: gather the keys each request may see, then an explicit masked softmax.

Runs anywhere torch runs (CPU tests, GPU cross-checks). Per layer kind `plan` packs the requests
into a few padded *groups* — all decodes (one query each) in one group, prefill chunks of similar
shape in another — and builds, once per batch, each group's query rows, padded key slots and an
additive mask. Per layer, a group is then two batched matmuls over every request in it, so the
cost per step does not grow with a Python loop over requests.

Scores follow the HF eager order: ``(q @ k^T) * scaling`` → tanh softcap → mask → softmax in
float32, with a sink column appended per head when the layer has sinks (its probability is
dropped after the softmax, so it only enlarges the denominator).

On a float32 CPU pool `cpu_kernel`'s C kernel takes every query row of the step in one call per
layer, each row with the run of key slots it may see (causal, windowed), read straight from the
pool (docs/design.md §21): decodes one by one, a prefill chunk's rows in blocks of neighbours
(2.2-2.6x faster than the SDPA groups even on a dense full-attention chunk). The groups are the
whole path everywhere else (GPU cross-checks, other dtypes, no C compiler,
``SWASERVE_CPU_KERNEL=0``).

A prefill group in float32 with neither softcap nor sinks (Gemma 3, Mistral, MiMo, Cohere 2)
goes through `F.scaled_dot_product_attention` instead, with the same additive mask: its CPU
kernel never materialises the ``[G*Hq, Q, L]`` scores (a prefill step of 8 prompts × 256 tokens of
the 46M Gemma-3, one thread: 1,616 → 1,445 ms, the two backends alternating in one process).

Layout inside a group (G requests, Q queries and L keys each, padded)::

    keys   gathered head-major: [Hkv, G*L, D]   (one index_select per KV head, no transposes)
    scores [Hkv*G, g*Q, L] = bmm(q [Hkv*G, g*Q, D], k^T)     g = Hq // Hkv (HF `repeat_kv`)
    out    [Hkv*G, g*Q, Dv] = bmm(probs, v) → [G*Q, Hq, Dv]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend, AttentionLayer, AttnBatch, KVView
from worker.models.spec import LayerKind

if TYPE_CHECKING:
    from worker.kv.pool import HybridKVPool

# A prefill group is padded to its longest query and key range; start another group when the
# padding would exceed this multiple of the real work (scores computed / scores needed).
MAX_PADDING = 1.5

@dataclass(frozen=True)
class _Group:
    """Requests attended together. Tensors are on the model device."""

    size: int  # G requests
    q_len: int  # Q: queries per request, padded
    kv_len: int  # L: keys per request, padded
    rows: torch.Tensor | None  # int64 [G*Q]: query rows (pads repeat a real row); None: all rows
    kv_idx: torch.Tensor  # int64 [G*L]: key slots, padded with the dummy slot 0
    bias: torch.Tensor | None  # float32 [G, Q, L]: 0 where the key is visible, -inf elsewhere
    # (None: every key is visible to every query)
    keep: torch.Tensor | None  # int64 [n]: the real queries among the G*Q; None: all are real
    out_rows: torch.Tensor | None  # int64 [n]: the rows they answer; None: the whole output
    # Per KV-head count: `kv_idx` as rows of the pool viewed ``[slots*H, D]``, head-major, so
    # one gather per layer lays the keys out per head (built by the first layer of the step).
    head_rows: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class _Rows:
    """The CPU kernel's plan for one layer kind: query row r reads the key slots
    ``slots[start[r] : start[r] + count[r]]`` (int64 tensors on the CPU)."""

    slots: torch.Tensor  # the view's flat key slots
    start: torch.Tensor  # [T]
    count: torch.Tensor  # [T]


@dataclass(frozen=True)
class TorchMetadata:
    per_kind: dict[LayerKind, tuple[_Group, ...]]
    num_tokens: int
    rows: dict[LayerKind, _Rows] = field(default_factory=dict)  # kinds the kernel runs


class _Member(NamedTuple):
    """One request's part of a group, from host values only (planning never syncs a device).

    A NamedTuple: built for every request of every step, twice (once per layer kind)."""

    idx: int  # the request's index in the batch
    q_off: int  # first query row
    q_len: int
    prefix: int  # position of its first query
    kv_off: int  # its range in the view's indices
    kv_len: int
    kv_start: int  # position of its first key


def _members(batch: AttnBatch, view: KVView) -> list[_Member]:
    out, q_off, kv_off = [], 0, 0
    for i, (q, seq, start) in enumerate(zip(batch.q_lens, batch.seq_lens, view.kv_starts)):
        out.append(_Member(i, q_off, q, seq - q, kv_off, seq - start, start))
        q_off += q
        kv_off += seq - start
    return out


def _buckets(extends: list[_Member]) -> list[list[_Member]]:
    """Prefill chunks grouped by shape so that padding stays under MAX_PADDING."""
    groups: list[list[_Member]] = []
    for m in sorted(extends, key=lambda m: (m.q_len, m.kv_len)):
        cur = groups[-1] if groups else None
        if cur is not None:
            q, kv = max(m.q_len, cur[-1].q_len), max(m.kv_len, max(c.kv_len for c in cur))
            real = sum(c.q_len * c.kv_len for c in cur) + m.q_len * m.kv_len
            if (len(cur) + 1) * q * kv <= MAX_PADDING * real:
                cur.append(m)
                continue
        groups.append([m])
    return groups


def _col(values: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=dev)[:, None]


def _slots(
    members: list[_Member], view: KVView, L: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key slots ``[G*L]`` padded with slot 0, and which are real ``[G, L]`` (None: all).
    Gathered on the device from either form of the view (flat, or the paged device table)."""
    if len(members) == 1:
        m = members[0]
        return view.segment(m.idx, m.kv_off, L), None
    return view.padded([m.idx for m in members], [m.kv_off for m in members], L)


def _decode_group(members: list[_Member], view: KVView, window: int | None, total: int) -> _Group:
    """One query per request at position ``prefix``: every key of its view is visible (the view
    ends at the query and, on SWA layers, starts at the window) except padding."""
    dev = view.device
    G, L = len(members), max(m.kv_len for m in members)
    kv_idx, visible = _slots(members, view, L)
    if window is not None and any(m.kv_start < m.prefix - window for m in members):
        k_pos = _col([m.kv_start for m in members], dev) + torch.arange(L, device=dev)[None, :]
        in_window = k_pos >= _col([m.prefix for m in members], dev) - window
        visible = in_window if visible is None else visible & in_window
    bias = None
    if visible is not None:
        bias = torch.zeros(G, 1, L, device=dev).masked_fill_(~visible[:, None, :], float("-inf"))
    if G == total and all(m.q_off == i for i, m in enumerate(members)):
        return _Group(G, 1, L, None, kv_idx, bias, None, None)
    rows = torch.tensor([m.q_off for m in members], dtype=torch.int64, device=dev)
    return _Group(G, 1, L, rows, kv_idx, bias, None, rows)


def _extend_group(members: list[_Member], view: KVView, window: int | None, total: int) -> _Group:
    dev = view.device
    G, Q, L = len(members), max(m.q_len for m in members), max(m.kv_len for m in members)
    kv_idx, key_ok = _slots(members, view, L)
    j, ell = torch.arange(Q, device=dev)[None, :], torch.arange(L, device=dev)[None, :]
    q_len = _col([m.q_len for m in members], dev)
    q_pos = _col([m.prefix for m in members], dev) + j  # [G, Q]
    k_pos = _col([m.kv_start for m in members], dev) + ell  # [G, L]
    visible = k_pos[:, None, :] <= q_pos[:, :, None]
    if key_ok is not None:
        visible &= key_ok[:, None, :]
    if window is not None:
        visible &= k_pos[:, None, :] >= q_pos[:, :, None] - window
    q_ok = j < q_len  # [G, Q]
    # NOTE: a padded query sees key 0 only, so its softmax stays finite (its row is dropped).
    visible |= (~q_ok)[:, :, None] & (ell == 0)[:, None, :]
    bias = torch.zeros(G, Q, L, device=dev).masked_fill_(~visible, float("-inf"))
    if G * Q == total and all(m.q_len == Q for m in members) and _in_order(members):
        return _Group(G, Q, L, None, kv_idx, bias, None, None)
    rows = (_col([m.q_off for m in members], dev) + torch.minimum(j, q_len - 1)).reshape(-1)
    keep = q_ok.reshape(-1).nonzero().squeeze(1)
    return _Group(G, Q, L, rows, kv_idx, bias, keep, rows[keep])


def _in_order(members: list[_Member]) -> bool:
    return all(m.q_off == i * members[0].q_len for i, m in enumerate(members))


def _plan_kind(
    batch: AttnBatch, view: KVView, window: int | None, kernel: bool = False
) -> tuple[tuple[_Group, ...], _Rows | None]:
    """The groups of this kind, or with `kernel` the kernel's rows (every query's)."""
    if kernel:
        return (), _kernel_rows(batch, view, window)
    members = _members(batch, view)
    total = sum(batch.q_lens)
    decodes = [m for m in members if m.q_len == 1]
    extends = _buckets([m for m in members if m.q_len > 1])
    groups = [_decode_group(decodes, view, window, total)] if decodes else []
    return tuple(groups + [_extend_group(g, view, window, total) for g in extends]), None


# Decode batches up to this size plan the kernel's rows in plain Python (in a batch-1..8 decode
# step, after the forward streamed the weights through the cache, the numpy ops took ~0.1 ms
# per layer kind; the loop is a few microseconds per request).
_PY_DECODE_ROWS = 64


def _kernel_rows(batch: AttnBatch, view: KVView, window: int | None) -> _Rows:
    """Each query row's run of visible keys in the view's flat slots: query j of request i, at
    position ``p = prefix + j``, sees positions ``max(kv_start, p - window) .. p``. Host work
    O(tokens) in numpy (a few vector ops per step, no Python loop over tokens); a batch of
    single-row decodes in plain Python (one row per request: cheaper than the numpy ops)."""
    if len(batch.q_lens) <= _PY_DECODE_ROWS and all(q == 1 for q in batch.q_lens):
        return _decode_rows(batch, view, window)
    q_lens = np.asarray(batch.q_lens, dtype=np.int64)
    seq = np.asarray(batch.seq_lens, dtype=np.int64)
    kv_start = np.asarray(view.kv_starts, dtype=np.int64)
    kv_len = seq - kv_start
    kv_off = np.cumsum(kv_len) - kv_len
    q_off = np.cumsum(q_lens) - q_lens
    member = np.repeat(np.arange(len(q_lens)), q_lens)
    pos = (seq - q_lens)[member] + np.arange(int(q_lens.sum())) - q_off[member]
    first = kv_start[member]
    if window is not None:
        first = np.maximum(first, pos - window)
    start = kv_off[member] + first - kv_start[member]
    count = pos - first + 1
    return _Rows(view.flat_indices().contiguous(), torch.from_numpy(start), torch.from_numpy(count))


def _decode_rows(batch: AttnBatch, view: KVView, window: int | None) -> _Rows:
    """`_kernel_rows` of a batch of single-row decodes, in plain Python."""
    starts, counts, off = [], [], 0
    for seq_len, kv_start in zip(batch.seq_lens, view.kv_starts):
        pos = seq_len - 1
        first = kv_start if window is None else max(kv_start, pos - window)
        starts.append(off + first - kv_start)
        counts.append(pos - first + 1)
        off += seq_len - kv_start
    return _Rows(view.flat_indices().contiguous(), torch.tensor(starts, dtype=torch.int64),
                 torch.tensor(counts, dtype=torch.int64))  # fmt: skip


def _gather(buf: torch.Tensor, grp: _Group) -> torch.Tensor:
    """Rows `grp.kv_idx` of ``buf [slots, H, D]`` as ``[H, len(idx), D]`` (head-major,
    contiguous): one gather from the pool seen as ``[slots*H, D]``."""
    heads, dim = buf.shape[1], buf.shape[2]
    if heads == 1:
        return buf.index_select(0, grp.kv_idx).view(1, -1, dim)
    rows = grp.head_rows.get(heads)
    if rows is None:
        h = torch.arange(heads, device=grp.kv_idx.device)[:, None]
        rows = grp.head_rows[heads] = (grp.kv_idx[None, :] * heads + h).reshape(-1)
    return buf.view(-1, dim).index_select(0, rows).view(heads, -1, dim)


def _sdpa_group(grp: _Group, qg: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                layer: AttentionLayer) -> torch.Tensor:  # fmt: skip
    """A prefill group through `F.scaled_dot_product_attention` (no softcap, no sinks)."""
    G, Q, L = grp.size, grp.q_len, grp.kv_len
    hkv = layer.num_kv_heads
    k = k_buf.index_select(0, grp.kv_idx).view(G, L, hkv, -1).transpose(1, 2)
    v = v_buf.index_select(0, grp.kv_idx).view(G, L, hkv, -1).transpose(1, 2)
    q4 = qg.view(G, Q, layer.num_q_heads, -1).transpose(1, 2)
    mask = None if grp.bias is None else grp.bias[:, None]
    out = F.scaled_dot_product_attention(
        q4, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=hkv != layer.num_q_heads
    )
    return out.transpose(1, 2).reshape(G * Q, layer.num_q_heads, -1)


def group_attention(
    grp: _Group,
    q: torch.Tensor,  # [T, Hq, D]
    k_buf: torch.Tensor,  # [slots, Hkv, D]
    v_buf: torch.Tensor,  # [slots, Hkv, Dv]
    layer: AttentionLayer,
    sinks: torch.Tensor | None,  # [Hq]
) -> torch.Tensor:
    """Attention of one group: ``[G*Q, Hq, Dv]`` in query order (padded queries included)."""
    G, Q, L = grp.size, grp.q_len, grp.kv_len
    hkv, hq, d = layer.num_kv_heads, layer.num_q_heads, q.shape[-1]
    g = hq // hkv
    qg = q if grp.rows is None else q.index_select(0, grp.rows)
    if Q > 1 and layer.softcap is None and sinks is None and q.dtype == torch.float32:
        return _sdpa_group(grp, qg, k_buf, v_buf, layer)
    q3 = qg.reshape(G, Q, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv * G, g * Q, d)
    k = _gather(k_buf, grp).view(hkv * G, L, d)
    scores = (torch.bmm(q3, k.transpose(1, 2)) * layer.scaling).float()
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.view(hkv, G, g, Q, L)
    if grp.bias is not None:
        scores = scores + grp.bias[None, :, None]
    if sinks is not None:
        sink = sinks.float().view(hkv, 1, g, 1, 1).expand(hkv, G, g, Q, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    v = _gather(v_buf, grp).view(hkv * G, L, -1)
    out = torch.bmm(probs.reshape(hkv * G, g * Q, L).to(v.dtype), v)
    return out.view(hkv, G, g, Q, -1).permute(1, 3, 0, 2, 4).reshape(G * Q, hq, -1)


class TorchBackend(AttentionBackend):
    """Reference attention over a `HybridKVPool` (any device)."""

    name = "torch"

    def __init__(self, pool: HybridKVPool, kernel: bool | None = None) -> None:
        """`kernel`: attend through the CPU kernel (`cpu_kernel`); None: when the pool is
        float32 on the CPU and the kernel builds here (SWASERVE_CPU_KERNEL is read now). True
        insists (ValueError when it cannot be had); False: the groups."""
        self.pool = pool
        self.kernel = None
        if kernel is False:
            return
        from worker.attention.cpu_kernel import attention_kernel

        device, dtype = getattr(pool, "device", None), getattr(pool, "dtype", None)
        fits = device is not None and torch.device(device).type == "cpu" and dtype == torch.float32
        self.kernel = attention_kernel() if fits else None
        if kernel and self.kernel is None:
            why = "the pool is not float32 on the CPU" if not fits else "it is off or did not build"
            raise ValueError(f"the CPU attention kernel cannot run: {why} (see the log)")

    def plan(self, batch: AttnBatch) -> TorchMetadata:
        per_kind, rows = {}, {}
        for kind, view in batch.kv.items():
            window = batch.window if kind is LayerKind.SWA else None
            per_kind[kind], kind_rows = _plan_kind(batch, view, window, self.kernel is not None)
            if kind_rows is not None:
                rows[kind] = kind_rows
        return TorchMetadata(per_kind=per_kind, num_tokens=sum(batch.q_lens), rows=rows)

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        metadata: TorchMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_buf, v_buf = self.pool.kv_buffers(layer.layer_id)
        groups, rows = metadata.per_kind[layer.kind], metadata.rows.get(layer.kind)
        if rows is not None:  # the kernel answers every row
            return self._kernel_forward(rows, q, k_buf, v_buf, layer, sinks)
        if len(groups) == 1 and groups[0].out_rows is None:  # one group, rows in order
            return group_attention(groups[0], q, k_buf, v_buf, layer, sinks)
        out = q.new_empty(q.shape[0], layer.num_q_heads, layer.v_head_dim)
        for grp in groups:
            res = group_attention(grp, q, k_buf, v_buf, layer, sinks)
            if grp.keep is not None:
                res = res.index_select(0, grp.keep)
            assert grp.out_rows is not None
            out.index_copy_(0, grp.out_rows, res.to(out.dtype))
        return out

    def _kernel_forward(
        self,
        rows: _Rows,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayer,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        from worker.attention.cpu_kernel import attention

        assert self.kernel is not None
        assert k_buf.is_contiguous() and v_buf.is_contiguous(), "pool buffers are contiguous"
        q32 = q
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q32 = q.float().contiguous()
        out = torch.empty(q.shape[0], layer.num_q_heads, layer.v_head_dim, dtype=torch.float32)
        sink32 = None if sinks is None else sinks.detach().float().contiguous()
        attention(
            self.kernel, q32, k_buf, v_buf, rows.slots, rows.start, rows.count, layer.scaling,
            layer.softcap, sink32, out,
        )  # fmt: skip
        return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["TorchBackend", "TorchMetadata", "group_attention"]

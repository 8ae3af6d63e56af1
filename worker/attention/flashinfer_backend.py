"""FlashInfer backend (CUDA only): one paged-prefill wrapper per layer kind.

Everything runs at token granularity (FlashInfer page size 1): the KV pools' rows are the pages
and the per-kind `KVView` indices are the page indices, so the SWA view (translated once by the
runner) and the FULL view plug in directly. Decodes and prefill chunks share one wrapper (a
decode is a one-token query).

Per kind, planned once per batch (lazily, on the first layer of that kind, because the heads,
scale, softcap and sinks are the layer's):

- SWA: ``window_left = window`` at plan time (a query at q sees q-window … q; the view starts
  at ``max(0, prefix_len - window)``, and FlashInfer anchors queries at the end of each request's
  keys, so positions line up);
- sinks: `BatchAttentionWithAttentionSinkWrapper`, sinks passed per layer at run time (float32);
- softcap: ``logits_soft_cap`` at plan time (Gemma 2).

Kernel choice (FA2 or Hopper's FA3): the plain paged wrapper chooses at each plan, FA2 for
queries of at most 64 rows (FA3's 128-row query tiles are mostly empty on a decode). The sink
wrapper fixes its kernel when it is built, so there is one sink wrapper per choice and each
batch picks (`sink_backend`): FA2 for a batch whose longest query has at most
`FA2_MAX_QUERY_ROWS` rows (decodes, short chunks), FlashInfer's own choice otherwise.

Head dims must be multiples of 16, at most 256 (FlashInfer's kernels; `check_head_dims`).

CUDA graphs (`plan_graph`, docs/design.md §18.2): a decode batch padded to a captured size is
planned into per-size wrappers built with ``use_cuda_graph=True`` and fixed buffers, outside the
graph; the graph's kernels read those buffers on replay.

NOTE: FlashInfer kernels take float16/bfloat16 only; float32 models use the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from worker.attention.base import AttentionBackend, AttentionLayer, AttnBatch
from worker.models.spec import LayerKind, ModelSpec

if TYPE_CHECKING:
    from worker.kv.pool import HybridKVPool

WORKSPACE_BYTES = 256 * 1024 * 1024
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FA2_MAX_QUERY_ROWS = 64  # FlashInfer's own threshold for its plain wrapper
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 16, 256


def sink_backend(q_lens: tuple[int, ...]) -> str:
    """The kernel a sink wrapper is built for, per batch: ``fa2`` when every query has at most
    `FA2_MAX_QUERY_ROWS` rows, else ``auto`` (FA3 on Hopper where it supports the dims)."""
    return "fa2" if max(q_lens, default=1) <= FA2_MAX_QUERY_ROWS else "auto"


def check_head_dims(spec: ModelSpec) -> None:
    """Raise ValueError naming a layer kind whose head dims FlashInfer's kernels cannot run."""
    for kind in dict.fromkeys(spec.layer_kinds):  # each kind once, in layer order
        shape = spec.shape(kind)
        for what, dim in (("head_dim", shape.head_dim), ("v_head_dim", shape.v_head_dim)):
            if dim % HEAD_DIM_MULTIPLE or dim > MAX_HEAD_DIM:
                raise ValueError(
                    f"FlashInfer cannot run the {kind.value} layers' {what} {dim}: its kernels "
                    f"take multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}; use "
                    "attention_backend='torch' for this model"
                )


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise ImportError(
            "attention_backend='flashinfer' needs the flashinfer-python package on a CUDA host "
            "(pip install -e '.[gpu]'); use attention_backend='torch' otherwise"
        ) from exc
    return flashinfer


@dataclass(frozen=True)
class _PlanKey:
    """Everything a kind's wrapper is compiled and planned for; all layers of a kind agree."""

    kind: LayerKind
    sinks: bool
    window_left: int  # -1: no window
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    softcap: float | None
    backend: str  # what a sink wrapper is built for (`sink_backend`); "auto" without sinks

    @classmethod
    def of(cls, layer: AttentionLayer, batch: AttnBatch, sinks: bool) -> _PlanKey:
        window = batch.window
        window_left = window if layer.kind is LayerKind.SWA and window is not None else -1
        backend = sink_backend(tuple(batch.q_lens)) if sinks else "auto"
        return cls(
            layer.kind, sinks, window_left, layer.num_q_heads, layer.num_kv_heads,
            layer.head_dim, layer.v_head_dim, layer.scaling, layer.softcap, backend,
        )  # fmt: skip


@dataclass(frozen=True)
class _KindPlan:
    key: _PlanKey
    wrapper: Any


@dataclass
class FlashInferMetadata:
    batch: AttnBatch
    qo_indptr: torch.Tensor  # int32 [B + 1], host
    kv_indptr: dict[LayerKind, torch.Tensor]  # int32 [B + 1], host
    kv_indices: dict[LayerKind, torch.Tensor]  # int32, device
    planned: dict[LayerKind, _KindPlan] = field(default_factory=dict)


def _host_indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return out


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer over a `HybridKVPool` on a CUDA device."""

    name = "flashinfer"

    def __init__(self, pool: HybridKVPool, spec: ModelSpec, device: str | torch.device) -> None:
        self.flashinfer = _import_flashinfer()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(
                f"attention_backend='flashinfer' runs on CUDA only, got device={self.device}; "
                "use attention_backend='torch' on CPU"
            )
        if pool.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"FlashInfer kernels take float16/bfloat16 KV, the pool is {pool.dtype}; "
                "set dtype='bfloat16' or use attention_backend='torch'"
            )
        check_head_dims(spec)
        self.pool = pool
        self.spec = spec
        self.dtype = pool.dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[_PlanKey, Any] = {}  # reused across batches; planned per batch
        # CUDA graphs (worker/runner/cuda_graphs.py): one wrapper per (batch size, key) whose
        # plan writes into fixed buffers the captured kernels read; page indices per kind in one
        # buffer shared by every size (one graph runs at a time).
        self._graph_wrappers: dict[tuple[int, _PlanKey], Any] = {}
        self._graph_indices: dict[LayerKind, torch.Tensor] = {}

    # ---- per batch ------------------------------------------------------------------------------
    def plan(self, batch: AttnBatch) -> FlashInferMetadata:
        kv_indptr, kv_indices = {}, {}
        for kind, view in batch.kv.items():
            lengths = [seq - start for seq, start in zip(batch.seq_lens, view.kv_starts)]
            kv_indptr[kind] = _host_indptr(lengths)
            # A paged FULL view gathers its page indices from the device page table here.
            kv_indices[kind] = view.flat_indices().to(device=self.device, dtype=torch.int32)
        return FlashInferMetadata(batch, _host_indptr(list(batch.q_lens)), kv_indptr, kv_indices)

    def _wrapper(self, key: _PlanKey) -> Any:
        if key not in self._wrappers:
            fi = self.flashinfer
            if key.sinks:
                self._wrappers[key] = fi.BatchAttentionWithAttentionSinkWrapper(
                    self.workspace, "NHD", q_data_type=self.dtype, kv_data_type=self.dtype,
                    head_dim_qk=key.head_dim, head_dim_vo=key.v_head_dim,
                    window_left=key.window_left, backend=key.backend,
                )  # fmt: skip
            else:
                self._wrappers[key] = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self._wrappers[key]

    def _graph_wrapper(self, bs: int, key: _PlanKey, capacity: int) -> Any:
        if (bs, key) not in self._graph_wrappers:
            fi, dev, i32 = self.flashinfer, self.device, torch.int32
            indices = self._graph_indices.get(key.kind)
            if indices is None or indices.numel() < capacity:
                indices = self._graph_indices[key.kind] = torch.empty(capacity, dtype=i32, device=dev)
            bufs = dict(
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty(bs + 1, dtype=i32, device=dev),
                paged_kv_indptr_buf=torch.empty(bs + 1, dtype=i32, device=dev),
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=torch.empty(bs, dtype=i32, device=dev),
            )
            if key.sinks:
                wrapper = fi.BatchAttentionWithAttentionSinkWrapper(
                    self.workspace, "NHD", q_data_type=self.dtype, kv_data_type=self.dtype,
                    head_dim_qk=key.head_dim, head_dim_vo=key.v_head_dim,
                    window_left=key.window_left, backend=key.backend, **bufs,
                )  # fmt: skip
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **bufs)
            self._graph_wrappers[(bs, key)] = wrapper
        return self._graph_wrappers[(bs, key)]

    def plan_graph(
        self,
        bs: int,
        batch: AttnBatch,
        layers: list[tuple[AttentionLayer, bool]],
        capacity: dict[LayerKind, int],
    ) -> FlashInferMetadata:
        """Plan a padded decode batch of exactly `bs` requests into the graph wrappers of that
        size, every kind at once (outside the graph; the captured kernels read what this
        writes). `layers`: every attention layer and whether it has sinks."""
        if batch.batch_size != bs:
            raise ValueError(f"plan_graph: the batch has {batch.batch_size} requests, the graph {bs}")
        meta = self.plan(batch)
        for layer, sinks in layers:
            key = _PlanKey.of(layer, batch, sinks)
            done = meta.planned.get(key.kind)
            if done is not None:
                if done.key != key:
                    raise ValueError(
                        f"layer {layer.layer_id} differs from the other {layer.kind.value} layers "
                        f"({key} vs {done.key}); FlashInfer plans once per kind per batch"
                    )
                continue
            wrapper = self._graph_wrapper(bs, key, capacity[key.kind])
            meta.planned[key.kind] = self._plan_kind(meta, key, wrapper)
        return meta

    def _plan_kind(self, meta: FlashInferMetadata, key: _PlanKey, wrapper: Any = None) -> _KindPlan:
        wrapper = wrapper if wrapper is not None else self._wrapper(key)
        extra: dict[str, Any] = {}
        if not key.sinks:
            extra = {"sm_scale": key.scaling, "logits_soft_cap": key.softcap or 0.0}
        elif key.softcap is not None:
            raise NotImplementedError("FlashInfer's sink kernels have no logit softcap")
        wrapper.plan(
            meta.qo_indptr,
            meta.kv_indptr[key.kind],
            meta.kv_indices[key.kind],
            torch.ones(meta.batch.batch_size, dtype=torch.int32),  # page size 1: last pages full
            key.num_q_heads,
            key.num_kv_heads,
            key.head_dim,
            1,
            head_dim_vo=key.v_head_dim,
            causal=True,
            window_left=key.window_left,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            **extra,
        )
        return _KindPlan(key=key, wrapper=wrapper)

    # ---- per layer ------------------------------------------------------------------------------
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        metadata: FlashInferMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key = _PlanKey.of(layer, metadata.batch, sinks is not None)
        plan = metadata.planned.get(layer.kind)
        if plan is None:
            plan = metadata.planned[layer.kind] = self._plan_kind(metadata, key)
        elif plan.key != key:
            raise ValueError(
                f"layer {layer.layer_id} differs from the other {layer.kind.value} layers ({key} "
                f"vs {plan.key}); FlashInfer plans once per kind per batch"
            )
        k_buf, v_buf = self.pool.kv_buffers(layer.layer_id)
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [rows, page=1, heads, dim]
        return run_wrapper(plan.wrapper, q, paged, sinks, layer)


def run_wrapper(
    wrapper: Any,
    q: torch.Tensor,  # [T, Hq, D]
    paged: tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None,
    layer: AttentionLayer,
) -> torch.Tensor:
    """One layer through a planned wrapper, into an output it does not zero.

    NOTE: without `out`, FlashInfer's run allocates its output with `torch.zeros`: one fill
    kernel per layer per step for values the kernel overwrites anyway."""
    out = q.new_empty(q.shape[0], layer.num_q_heads, layer.v_head_dim)
    if sinks is not None:
        return wrapper.run(q.contiguous(), paged, sinks.float(), layer.scaling, out=out)
    return wrapper.run(q.contiguous(), paged, out=out)

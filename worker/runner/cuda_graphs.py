"""CUDA graphs of the decode forward, one per captured batch size (docs/design.md §18.2).

A decode step launches hundreds of small kernels; on a GPU the launches, not the math, bound it.
`DecodeGraphs` captures the model's forward once per batch size in `sizes` and replays it:

    host (every step)                                 device
    copy ids/positions/out_loc into static buffers,   ─┐
    pad to the captured size (slot 0, position 0)      │
    backend.plan_graph(size, padded batch)  ◀── plan outside the graph: writes the kernels'
                                                 page indices and work split into buffers
    graph.replay()                                     └▶ embed … attention (reads those
                                                          buffers) … final norm → hidden
    hidden[:B]

Padded rows are one-token requests at position 0 whose key and new slot are the dummy slot 0
(page 0 is reserved for padding in both pools), so they touch no real KV. Logits are computed
outside the graph on the real rows only. A batch with a prefill chunk, or larger than the
largest size, runs eagerly.

Only backends with a `plan_graph` (FlashInfer) can be captured: the torch reference builds new
tensors in `plan`, which a graph would not see. Models whose forward syncs the host (the MoE
layers count tokens per expert on the host) cannot be captured either; `capturable` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from worker.attention.base import AttentionLayer, AttnBatch, KVView
from worker.models.context import ForwardContext
from worker.models.spec import LayerKind

if TYPE_CHECKING:
    from worker.attention.base import AttentionBackend
    from worker.kv.pool import HybridKVPool
    from worker.models.causal_lm import CausalLM
    from worker.models.spec import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
WARMUP_RUNS = 2  # eager runs before each capture (lazy inits, autotuning, the allocator's pools)


def graph_batch_sizes(requested: Sequence[int] | None, max_running_requests: int) -> tuple[int, ...]:
    """The sizes to capture: the requested ones, else the defaults, up to max_running_requests
    (and that number itself, so every decode batch fits one)."""
    sizes = sorted({int(b) for b in (requested or DEFAULT_BATCH_SIZES) if 0 < int(b) <= max_running_requests})
    if not requested and (not sizes or sizes[-1] < max_running_requests):
        sizes.append(max_running_requests)
    return tuple(sizes)


def attention_layers_with_sinks(model: CausalLM) -> list[tuple[AttentionLayer, bool]]:
    """Every attention layer of the model and whether it has sinks (what a graph plans for)."""
    from worker.models.self_attention import SelfAttention

    out = []
    for block in model.model.layers:
        attn = block.self_attn
        assert isinstance(attn, SelfAttention), f"{type(block).__name__}.self_attn"
        out.append((attn.layer, attn.opts.sinks_name is not None))
    return out


def capturable(model: CausalLM, backend: AttentionBackend, device: torch.device) -> str | None:
    """Why this model cannot be captured on this backend and device, or None if it can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (device is {device})"
    if not callable(getattr(backend, "plan_graph", None)):
        return f"the {backend.name} attention backend cannot plan into a graph's buffers (use flashinfer)"
    from worker.models.moe import GptOssMoE, MiMoMoE

    if any(isinstance(m, (GptOssMoE, MiMoMoE)) for m in model.modules()):
        return "the model's MoE layers count tokens per expert on the host (a sync a graph cannot hold)"
    return None


class DecodeGraphs:
    """Captured decode forwards for a set of batch sizes (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        pool: HybridKVPool,
        backend: AttentionBackend,
        spec: ModelSpec,
        device: torch.device,
        sizes: Sequence[int],
        max_seq_len: int,
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model, self.pool, self.backend, self.spec = model, pool, backend, spec
        self.device = device
        self.sizes = tuple(sorted(set(sizes)))
        self.layers = attention_layers_with_sinks(model)
        # Page indices a graph's plan may hold per kind, at the largest size: FULL keys up to the
        # longest sequence the page table holds, SWA keys up to the window + the query.
        n_max = self.sizes[-1]
        self.capacity: dict[LayerKind, int] = {}
        if spec.full_layer_ids:
            self.capacity[LayerKind.FULL] = n_max * max_seq_len
        if spec.swa_layer_ids:
            self.capacity[LayerKind.SWA] = n_max * min(max_seq_len, (spec.window or max_seq_len) + 1)
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.pos = torch.zeros(n, dtype=torch.int64, device=device)
        self.out = torch.zeros(n, dtype=torch.int64, device=device)
        self.swa_out = torch.zeros(n, dtype=torch.int64, device=device) if spec.swa_layer_ids else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by a graph (tests and the GPU check read it)

    # ---- capture --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its memory pool)."""
        with torch.cuda.device(self.device):
            self._capture()

    def _capture(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            meta = self._plan(self._dummy(bs), bs)
            ctx = self._ctx(meta, bs)
            for _ in range(WARMUP_RUNS):
                self.model(self.ids[:bs], self.pos[:bs], ctx)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.hidden[bs] = self.model(self.ids[:bs], self.pos[:bs], ctx)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))

    def _ctx(self, meta: Any, bs: int) -> ForwardContext:
        swa = None if self.swa_out is None else self.swa_out[:bs]
        return ForwardContext(self.pool, self.backend, meta, self.out[:bs], swa)

    def _plan(self, batch: AttnBatch, bs: int) -> Any:
        return self.backend.plan_graph(bs, batch, self.layers, self.capacity)  # type: ignore[attr-defined]

    def _dummy(self, bs: int) -> AttnBatch:
        """`bs` one-token requests at position 0 reading slot 0 (what padding looks like)."""
        dev = self.device
        idx, ptr = torch.zeros(bs, dtype=torch.int64, device=dev), torch.arange(bs + 1, device=dev)
        views = {kind: KVView(idx, ptr, (0,) * bs, (1,) * bs) for kind in self.capacity}
        return AttnBatch((1,) * bs, (1,) * bs, self.pos[:bs], views, self.spec.window)

    # ---- replay ---------------------------------------------------------------------------------
    def can_run(self, q_lens: tuple[int, ...]) -> bool:
        return bool(self.graphs) and len(q_lens) <= self.sizes[-1] and all(q == 1 for q in q_lens)

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def run(
        self, attn: AttnBatch, ids: torch.Tensor, out_loc: torch.Tensor, swa_out: torch.Tensor | None
    ) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode batch, through the graph of the next size."""
        B = attn.batch_size
        bs = self.size_for(B)
        for buf, src in ((self.ids, ids), (self.pos, attn.positions), (self.out, out_loc)):
            buf[:B].copy_(src)
            buf[B:bs].zero_()
        if self.swa_out is not None:
            assert swa_out is not None
            self.swa_out[:B].copy_(swa_out)
            self.swa_out[B:bs].zero_()
        self._plan(self._padded(attn, bs), bs)  # the plan, outside the graph
        # NOTE: a replay launches on the current device's stream, and the step thread is not
        # the thread that built the engine (whose current device `select_device` set).
        with torch.cuda.device(self.device):
            self.graphs[bs].replay()
        self.replays += 1
        return self.hidden[bs][:B]

    def _padded(self, attn: AttnBatch, bs: int) -> AttnBatch:
        """`attn` plus `bs - B` padding requests, every view flattened on the device."""
        pad = bs - attn.batch_size
        dev = self.device
        views = {}
        for kind, v in attn.kv.items():
            lens = tuple(v.kv_len(i) for i in range(attn.batch_size)) + (1,) * pad
            idx = torch.cat([v.flat_indices(), torch.zeros(pad, dtype=torch.int64, device=dev)])
            views[kind] = KVView(idx, None, tuple(v.kv_starts) + (0,) * pad, lens)
        return AttnBatch(
            attn.q_lens + (1,) * pad, attn.seq_lens + (1,) * pad, self.pos[:bs], views, attn.window
        )

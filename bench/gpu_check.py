"""`swaserve bench gpu-check`: the GPU paths in one run, one table (docs/design.md §18.2-18.3).

Written to run in one go within one lease of a lent GPU (≤ 9 minutes, FlashInfer's JIT builds
included: `bench/gpu_device_check.sh`); every step that cannot run here is listed as skipped
with its reason, never as passed (the CPU dry run). Steps, in order (the cheap ones first, and
the table is rewritten under --out after each, so a timeout keeps what ran):

1. **kernels**: FlashInfer vs the torch backend on the same random pool and batches (decodes and
   prefill chunks): full GQA (flat and paged view), SWA window, SWA with sinks (GPT-OSS, head
   dim 64), MiMo-V2-Flash's head dims (192 q/k, 128 v; full and SWA with sinks), and a split-KV
   long decode (two decodes over 32k and 20k keys): max |difference|, bf16 tolerance.
2. **greedy**: a random dense Gemma-3-style model (5 sliding : 1 full layers, bf16) saved with
   transformers, served by three engines on the same prompts: torch backend, FlashInfer eager,
   FlashInfer with decode CUDA graphs. Greedy tokens agreeing before the first divergence
   (bf16 near-ties may flip late), and how many decode steps replayed a graph.
3. **graph vs eager logits**: one decode batch run through the graph and eagerly on the same
   inputs (the same KV written twice): max |logit difference| and replays; the dense model
   and the built-in tiny MiMo (MoE, sinks), `compile` off and auto; and 16 greedy tokens per
   engine, compile auto vs off agreeing. MoE models are not captured (their experts' token
   counts go to the host): their graph rows say so, skipped.
4. **overlap**: FlashInfer with graphs, overlap scheduling on vs off: greedy tokens agree.
5. **quantized**: the GPU kernels that read `quantized_weights: keep`'s packed weights vs its
   reference path (dequantized per call): GPT-OSS-120B-shaped MXFP4 experts (hidden and
   intermediate 2880, 32 experts, top 4) through FlashInfer's fused SM90 MoE kernel, 1, 8 and
   300 tokens, within bf16 tolerance; MiMo-V2-Flash-shaped block-FP8 linears through its SM90
   blockwise GEMM, 1 and 300 tokens, within FP8 input rounding. Each skipped with its reason
   where it cannot run (not SM90, or the FlashInfer module absent: the device carry holds
   neither, docs/design.md §18.3).
6. **bandwidth**: B requests at context C decode N steps (synchronised, wall time per step),
   eager and with graphs; every request is admitted before the first one can finish (each
   asks for more tokens than the steps that admit the others take); achieved GB/s
   = (weight bytes + KV bytes the step reads) / step time, KV read = per request, full layers
   x context + SWA layers x min(context, window + 1), K and V; against the device's peak
   (H100/H200: 3.35/4.8 TB/s; a device-to-device copy measures ~4.3 on an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.harness import markdown_table

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"
NO_FLASHINFER = "flashinfer is not importable (pip install -e '.[gpu]', or the device carry: bench/gpu_carry.py)"
ATOL = 2e-2
DTYPE = torch.bfloat16
PEAK_TBS = {"H200": 4.8, "H100": 3.35}  # HBM3e / HBM3 spec sheets


@dataclass(frozen=True)
class GpuCheckSettings:
    hidden: int = 2048
    layers: int = 12
    vocab: int = 32_000
    prompts: int = 4
    new_tokens: int = 32
    batch: int = 64
    context: int = 4096
    steps: int = 20
    step_tokens: int = 8192  # max_num_batched_tokens: what one step may prefill, decodes included
    # SWA pool / full pool; the SWA pool must hold every decode's window and one whole prompt
    # (a prompt keeps its SWA KV until its prefill ends)
    swa_ratio: float = 0.5


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    ok: bool | None  # None: a measurement, or skipped
    skipped: bool = False


@dataclass
class Context:
    """What the steps share: settings, a scratch directory, the models built on first use, and
    where they run (a CPU rehearsal runs the engine steps with the torch backend in place of
    FlashInfer: every code path but the kernels and graphs)."""

    s: GpuCheckSettings
    root: Path
    device: str = "cuda"
    backend: str = "flashinfer"
    models: dict[str, Path] = field(default_factory=dict)

    def dense(self) -> Path:
        if "dense" not in self.models:
            self.models["dense"] = dense_model_dir(self.root, self.s, self.device)
        return self.models["dense"]

    def moe(self) -> Path:
        """The built-in tiny MiMo-V2-Flash (MoE layer, sinks, window 32; head dim 64)."""
        if "moe" not in self.models:
            from worker.models.tiny import ensure_tiny_model

            self.models["moe"] = ensure_tiny_model(self.root / "cache")
        return self.models["moe"]


@dataclass(frozen=True)
class Step:
    name: str
    needs: tuple[str, ...]  # "cuda", "flashinfer"
    run: Callable[[Context], list[Row]]


def environment() -> dict[str, bool]:
    """What this machine offers the steps."""
    have = {"cuda": torch.cuda.is_available(), "flashinfer": False}
    if have["cuda"]:
        try:
            import flashinfer  # noqa: F401

            have["flashinfer"] = True
        except ImportError:
            pass
    return have


def skip_reason(step: Step, have: dict[str, bool]) -> str | None:
    """Why `step` cannot run on a machine offering `have`, or None."""
    why = {"cuda": NO_CUDA, "flashinfer": NO_FLASHINFER}
    return next((why[n] for n in step.needs if not have.get(n, False)), None)


# ---- 1. kernels ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelCase:
    name: str
    full: bool  # a FULL layer (else SWA)
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int
    sinks: bool
    q_lens: tuple[int, ...] = (1, 1, 37, 1, 200, 5)
    prefix: tuple[int, ...] = (300, 2, 0, 95, 150, 40)


KERNEL_CASES = (
    KernelCase("full GQA", True, 8, 2, 128, 128, 64, False),
    KernelCase("SWA window", False, 8, 2, 64, 64, 31, False),
    KernelCase("SWA sinks (GPT-OSS dims)", False, 8, 1, 64, 64, 127, True),
    KernelCase("MiMo full 192/128", True, 8, 1, 192, 128, 127, False),
    KernelCase("MiMo SWA sinks 192/128", False, 8, 2, 192, 128, 127, True),
    KernelCase("split-KV long decode", True, 8, 1, 128, 128, 127, False, (1, 1), (32_767, 20_000)),
)


def flashinfer_backend(pool: Any, spec: Any, device: str) -> Any:
    from worker.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(pool, spec, device)


def kernel_parity(ctx: Context | None = None, device: str = "cuda",
                  make: Callable[[Any, Any, str], Any] = flashinfer_backend, seed: int = 0) -> list[Row]:  # fmt: skip
    """Each `KERNEL_CASES` case through `make`'s backend and the torch backend (a CPU rehearsal
    passes another torch backend as `make`)."""
    from worker.attention.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for case in KERNEL_CASES:
        layer, spec, pool, sink, q, batches = _kernel_inputs(case, device, gen)
        for form, batch in batches.items():
            label = f"FlashInfer vs torch: {case.name}, {form} view"
            try:  # one case failing (a shape FlashInfer cannot build) must not hide the others
                fast, ref = make(pool, spec, device), TorchBackend(pool)
                got = fast.forward(layer, q, fast.plan(batch), sink)
                want = ref.forward(layer, q, ref.plan(batch), sink)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rows.append(Row(label, f"FAILED: {type(exc).__name__}: {exc}", False))
                continue
            diff = float((got.float() - want.float()).abs().max())
            rows.append(Row(label, f"max |diff| {diff:.4f}", diff < ATOL * 4))
    return rows


def _kernel_inputs(case: KernelCase, device: str, gen: torch.Generator) -> tuple[Any, ...]:
    """The layer, spec, pool (keys in shuffled slots), sinks, queries and batches of a case."""
    from worker.attention.base import AttentionLayer, AttnBatch, KVView
    from worker.models.spec import KindShape, LayerKind, ModelSpec

    kind = LayerKind.FULL if case.full else LayerKind.SWA
    seq = [p + n for p, n in zip(case.prefix, case.q_lens)]
    slots = sum(seq) + 1
    pool = _FakePool(
        torch.randn(slots, case.kv_heads, case.head_dim, generator=gen).to(device, DTYPE),
        torch.randn(slots, case.kv_heads, case.v_head_dim, generator=gen).to(device, DTYPE),
    )
    perm = (torch.randperm(slots - 1, generator=gen) + 1).to(device)
    table = torch.zeros(len(seq), max(seq), dtype=torch.int32, device=device)
    parts, starts, used = [], [], 0
    for i, n in enumerate(seq):
        table[i, :n] = perm[used : used + n].int()
        used += n
        start = 0 if case.full else max(0, case.prefix[i] - case.window)
        starts.append(start)
        parts.append(table[i, start:n].long())
    indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0).to(device)
    views = {"flat": KVView(torch.cat(parts), indptr, tuple(starts))}
    if case.full:
        rows_dev = torch.arange(len(seq), device=device)
        views["paged"] = KVView.paged(table, tuple(range(len(seq))), rows_dev, (0,) * len(seq), tuple(seq))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(case.prefix, case.q_lens)]).to(device)
    q = torch.randn(sum(case.q_lens), case.q_heads, case.head_dim, generator=gen).to(device, DTYPE)
    sink = (torch.randn(case.q_heads, generator=gen) * 2).to(device) if case.sinks else None
    layer = AttentionLayer(0, kind, case.q_heads, case.kv_heads, case.head_dim, case.v_head_dim,
                           scaling=case.head_dim**-0.5)  # fmt: skip
    shape = KindShape(case.q_heads, case.kv_heads, case.head_dim, case.v_head_dim, case.sinks)
    spec = ModelSpec("check", (LayerKind.FULL, LayerKind.SWA), case.window, shape, shape, 256, 64, 1 << 16)
    batches = {form: AttnBatch(case.q_lens, tuple(seq), positions, {kind: view}, case.window)
               for form, view in views.items()}  # fmt: skip
    return layer, spec, pool, sink, q, batches


@dataclass
class _FakePool:
    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype = DTYPE

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


# ---- 2-4. the engine ----------------------------------------------------------------------------
def dense_model_dir(root: Path, s: GpuCheckSettings, device: str = "cuda") -> Path:
    """A random Gemma-3-style model saved with transformers (weights drawn on `device`)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    heads = max(1, s.hidden // 128)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma3TextConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
        intermediate_size=4 * s.hidden, sliding_window=512, max_position_embeddings=32_768,
        layer_types=[types[i % 6] for i in range(s.layers)],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.zero_()  # Gemma norms scale by 1 + weight
    path = root / "dense"
    model.save_pretrained(path)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def engine_config(path: Path, backend: str, graphs: str, s: GpuCheckSettings, batch: int,
                  overlap: str = "auto", device: str = "cuda", compile: str = "auto") -> Any:  # fmt: skip
    from worker.config import EngineConfig

    running = max(batch, s.prompts)
    max_len = s.context + new_tokens(s) + 64
    return EngineConfig(
        model=str(path), dtype="bfloat16", device=device, attention_backend=backend,
        cuda_graphs=graphs, overlap_schedule=overlap, compile=compile,
        max_running_requests=running, max_num_batched_tokens=s.step_tokens,
        max_model_len=max_len, max_total_tokens=running * (max_len + 64),
        swa_full_tokens_ratio=s.swa_ratio,
    )  # fmt: skip


def _engine(ctx: Context, path: Path, graphs: str, s: GpuCheckSettings, batch: int, overlap: str = "auto",
            compile: str = "off", backend: str | None = None) -> Any:  # fmt: skip
    """An engine on the context's device and backend (`backend` overrides the latter).

    NOTE: compile off but where a row compares it (graph-logits): a torch.compile warm-up per
    engine would cost the lease minutes the kernels and graphs need."""
    from worker.engine.engine import Engine

    config = engine_config(path, backend or ctx.backend, graphs, s, batch, overlap, ctx.device, compile)
    return Engine(config)


def _close(engine: Any) -> None:
    engine.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


WARM_STEPS = 3  # bandwidth: untimed decode steps once every request decodes


def admission_steps(s: GpuCheckSettings) -> int:
    """Bandwidth: the most steps the engine takes to prefill every prompt (the decodes already
    running take their share of each step's `step_tokens` first)."""
    spare = s.step_tokens - s.batch
    assert spare > 0, f"step_tokens {s.step_tokens} leaves no room to prefill beside {s.batch} decodes"
    return -(-s.batch * s.context // spare) + s.batch  # + one partial chunk per prompt at most


def new_tokens(s: GpuCheckSettings) -> int:
    """Bandwidth: tokens per request, enough that the first admitted still decodes through the
    timed steps (it decodes from its admission on, while the later ones prefill)."""
    return admission_steps(s) + WARM_STEPS + s.steps + 16


def _prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _generate(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _agreement(label: str, a: list[list[int]], b: list[list[int]], n: int) -> Row:
    """Greedy tokens agreeing before the first divergence; bf16 near-ties may flip late (the
    graph wrappers split the keys differently), so at least the first 8 must agree."""
    same = [_agree(x, y) for x, y in zip(a, b)]
    return Row(label, f"agree {same} of {n} tokens", min(same) >= min(8, n))


# ---- 2. greedy ----------------------------------------------------------------------------------
def greedy_parity(ctx: Context) -> list[Row]:
    s, path = ctx.s, ctx.dense()
    prompts = _prompts(s.prompts, 200, s.vocab)
    outs, replays = {}, 0
    for label, backend, graphs in (("torch", "torch", "off"), ("flashinfer", None, "off"),
                                   ("flashinfer+graphs", None, "auto")):  # fmt: skip
        engine = _engine(ctx, path, graphs, s, s.prompts, backend=backend)
        outs[label] = _generate(engine, prompts, s.new_tokens)
        if engine.runner.graphs is not None:
            replays = engine.runner.graphs.replays
        _close(engine)
    return [
        _agreement("greedy torch vs flashinfer", outs["torch"], outs["flashinfer"], s.new_tokens),
        _agreement("greedy flashinfer vs flashinfer+graphs", outs["flashinfer"], outs["flashinfer+graphs"], s.new_tokens),
        Row("decode steps served by a graph", str(replays), replays > 0),
    ]


# ---- 3. graph vs eager logits -------------------------------------------------------------------
def graph_logits(ctx: Context) -> list[Row]:
    """Dense and MoE, `compile` off and auto: one decode batch with and without its graph, then
    a few greedy tokens per engine (compile auto vs off: the compiled model past its warm-up)."""
    s = replace(ctx.s, context=600)  # the tiny MiMo has 4096 positions
    rows = []
    for model, path in (("dense", ctx.dense()), ("MoE tiny MiMo", ctx.moe())):
        tokens = {}
        for compile in ("off", "auto"):
            label = f"graph vs eager logits, {model}, compile {compile}"
            try:  # the MoE failing must not hide the dense rows, nor compile auto compile off
                row, tokens[compile] = _graph_and_greedy(ctx, path, s, compile, label)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row = Row(label, f"FAILED: {type(exc).__name__}: {exc}", False)
            rows.append(row)
        if len(tokens) == 2:
            rows.append(_agreement(f"greedy compile off vs auto, {model}", tokens["off"], tokens["auto"], 16))
    return rows


def _graph_and_greedy(ctx: Context, path: Path, s: GpuCheckSettings, compile: str, label: str) -> tuple[Row, list[list[int]]]:
    from worker.runner.cuda_graphs import capturable

    # NOTE: overlap off: `graph_vs_eager` schedules and runs a batch itself, outside `step`,
    # which must leave no forward in flight (with overlap, the decodes' inputs would still be
    # sampling).
    engine = _engine(ctx, path, "auto", s, s.prompts, overlap="off", compile=compile)
    try:
        graphs, runner, vocab = engine.runner.graphs, engine.runner, engine.spec.vocab_size
        if graphs is None:
            row = _no_graphs(label, capturable(runner.model, runner.backend, runner.device))
        else:
            n, diff, same = graph_vs_eager(engine, _prompts(s.prompts, 300, vocab, seed=2))
            detail = f"{n} decodes: max |diff| {diff:.4f}, argmax equal {same}, {graphs.replays} replays"
            row = Row(label, detail, same and graphs.replays > 0)
        return row, _generate(engine, _prompts(2, 100, vocab, seed=5), 16)
    finally:
        _close(engine)


def _no_graphs(label: str, why: str | None) -> Row:
    """A model the runner does not capture by design is skipped with the reason; a capture that
    should have happened and did not fails."""
    if why is not None:
        return Row(label, f"skipped: {why}", None, skipped=True)
    return Row(label, "no graphs captured (see the log)", False)


def graph_vs_eager(engine: Any, prompts: list[list[int]]) -> tuple[int, float, bool]:
    """Bring `prompts` to decoding, then run one decode batch through the runner twice, with its
    graphs and without (the same KV written twice): batch size, max |logit diff|, argmax equal.
    The engine must not overlap (nothing may be in flight when the batch is scheduled here)."""
    from core.sampling_params import SamplingParams
    from worker.runner.forward_batch import ForwardBatch

    assert engine.forwarder.overlap is False, "graph_vs_eager needs overlap_schedule off"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    sc = engine.scheduler
    while sc.waiting or len(sc.running) < len(prompts) or not all(r.is_decoding for r in sc.running):
        engine.step()
    runner, work = engine.runner, sc.schedule()
    batch = ForwardBatch(tuple(w.forward_req() for w in work))
    host = runner._prepare(batch)
    q, seq = tuple(len(r.token_ids) for r in batch.reqs), tuple(r.seq_len for r in batch.reqs)
    with_graph = runner.execute(host, q, seq).logits
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(host, q, seq).logits
    runner.graphs = graphs
    diff = float((with_graph - eager).abs().max())
    return len(q), diff, bool((with_graph.argmax(-1) == eager.argmax(-1)).all())


# ---- 4. overlap ---------------------------------------------------------------------------------
def overlap_parity(ctx: Context) -> list[Row]:
    s, path = ctx.s, ctx.dense()
    prompts = _prompts(s.prompts, 200, s.vocab, seed=4)
    outs = {}
    for overlap in ("off", "on"):
        engine = _engine(ctx, path, "auto", s, s.prompts, overlap=overlap)
        outs[overlap] = _generate(engine, prompts, s.new_tokens)
        _close(engine)
    return [_agreement("greedy overlap off vs on (FlashInfer, graphs)", outs["off"], outs["on"], s.new_tokens)]


# ---- 5. quantized --------------------------------------------------------------------------------
QUANTIZED_SHAPE = (2880, 2880, 32, 4)  # GPT-OSS-120B's hidden, intermediate, top-k; 32 experts


def random_mxfp4_moe(device: str, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0) -> Any:
    """A GPT-OSS MoE block in bf16 whose experts are kept MXFP4 (`Mxfp4Experts`), random codes
    with scales around 2 ** -4 and small biases (built on meta: no float copy of the experts)."""
    from worker.models.moe import GptOssMoE
    from worker.models.quant.resident import Mxfp4Experts

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        moe = GptOssMoE(hidden, inter, experts, top_k, 1.702, 7.0)
        moe.experts = Mxfp4Experts.from_experts(moe.experts)
    moe.to_empty(device="cpu")
    with torch.no_grad():
        for name, t in [*moe.named_parameters(), *moe.named_buffers()]:
            if t.dtype != torch.uint8:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            else:
                lo, hi = (0, 256) if name.endswith("blocks") else (119, 125)
                t.copy_(torch.randint(lo, hi, t.shape, generator=gen, dtype=torch.int32).to(torch.uint8))
    return moe.to(device=device, dtype=DTYPE)


def quantized_parity(ctx: Context, shape: tuple[int, int, int, int] = QUANTIZED_SHAPE) -> list[Row]:
    """Each GPU kernel that reads weights kept quantized vs the per-call dequantization, or a
    row saying why it cannot run here (`mxfp4_moe_rows`, `fp8_linear_rows`)."""
    return mxfp4_moe_rows(ctx.device, shape) + fp8_linear_rows(ctx.device)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


def mxfp4_moe_rows(device: str, shape: tuple[int, int, int, int]) -> list[Row]:
    """GPT-OSS-120B-shaped MXFP4 experts: FlashInfer's fused SM90 kernel vs the per-expert
    dequantization, on decode (1 and 8 tokens) and prefill (300 tokens) batches."""
    from worker.models.quant.mxfp4_kernel import unavailable, use_fused_kernels

    label = "quantized: fused MXFP4 MoE vs per-expert"
    why = unavailable(torch.device(device), DTYPE)
    if why is not None:  # before building anything
        return [Row(label, f"skipped: {why}", None, skipped=True)]
    hidden, inter, experts, top_k = shape
    reference = random_mxfp4_moe(device, hidden, inter, experts, top_k)
    fused = random_mxfp4_moe(device, hidden, inter, experts, top_k)
    why = use_fused_kernels(fused, torch.device(device), DTYPE)
    if why is not None:
        return [Row(label, f"skipped: {why}", None, skipped=True)]
    gen = torch.Generator().manual_seed(3)
    rows = []
    with torch.inference_mode():
        for tokens in (1, 8, 300):
            x = torch.randn(tokens, hidden, generator=gen).to(device, DTYPE)
            rel = _relative(fused.mix(x), reference.mix(x))
            rows.append(Row(f"{label}, {tokens} tokens", f"max |diff| / max |ref| {rel:.4f}", rel < ATOL))
    return rows


# MiMo-V2-Flash's FP8 linears (out, in): q_proj, full-attention k_proj, o_proj, an expert's down_proj
FP8_SHAPES = ((12288, 4096), (768, 4096), (4096, 8192), (4096, 2048))


def fp8_linear_rows(device: str) -> list[Row]:
    """MiMo-V2-Flash-shaped block-FP8 linears: FlashInfer's SM90 blockwise GEMM (which rounds
    the input to FP8 per 1 x 128) vs the dequantized weight, 1 and 300 tokens."""
    from worker.models.quant.fp8_kernel import device_unavailable, use_fp8_kernels
    from worker.models.quant.resident import Fp8Linear

    label = "quantized: FP8 blockwise GEMM vs dequantized"
    why = device_unavailable(torch.device(device), DTYPE)
    if why is not None:
        return [Row(label, f"skipped: {why}", None, skipped=True)]
    gen = torch.Generator().manual_seed(4)
    rows = []
    for n, k in FP8_SHAPES:
        linear = Fp8Linear(torch.nn.Linear(k, n, bias=False, dtype=DTYPE), (128, 128))
        with torch.no_grad():
            linear.weight.copy_((torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn))
            linear.weight_scale_inv.copy_(torch.rand(linear.weight_scale_inv.shape, generator=gen) * 1e-3)
        linear = linear.to(device)
        kernel = torch.nn.Sequential(linear)
        why = use_fp8_kernels(kernel, torch.device(device), DTYPE)
        if why is not None:
            return [Row(label, f"skipped: {why}", None, skipped=True)]
        with torch.inference_mode():
            for tokens in (1, 300):
                x = torch.randn(tokens, k, generator=gen).to(device, DTYPE)
                got = linear(x)
                fallback, linear.kernel = linear.kernel, None
                want = linear(x)
                linear.kernel = fallback
                rel = _relative(got, want)
                # FP8 rounding of the input: ~2 ** -4 relative per element, averaged over K
                rows.append(Row(f"{label}, {n} x {k}, {tokens} tokens", f"max |diff| / max |ref| {rel:.4f}",
                                rel < 0.1 and fallback is not None))  # fmt: skip
    return rows


# ---- 6. bandwidth -------------------------------------------------------------------------------
def bandwidth(ctx: Context) -> list[Row]:
    from worker.models.quant.resident import stored_bytes

    s, path = ctx.s, ctx.dense()
    name = torch.cuda.get_device_name() if ctx.device.startswith("cuda") else ""
    peak = next((tbs for gpu, tbs in PEAK_TBS.items() if gpu in name), None)
    rows = []
    for graphs in ("off", "auto"):
        engine = _engine(ctx, path, graphs, s, s.batch)
        try:
            step_s = steady_decode(engine, s)
            weights = stored_bytes(engine.runner.model)
            kv = kv_bytes_read(engine.spec, s.batch, s.context + 5)
        finally:
            _close(engine)
        gbs = (weights + kv) / step_s / 1e9
        of_peak = f", {gbs / (peak * 1e3):.0%} of {peak} TB/s" if peak else ""
        label = "graphs" if graphs == "auto" else "eager"
        rows.append(Row(
            f"decode bandwidth, {label}, batch {s.batch} x {s.context} context",
            f"{step_s * 1e3:.2f} ms/step, {(weights + kv) / 1e9:.2f} GB read, {gbs:,.0f} GB/s{of_peak}",
            None,
        ))  # fmt: skip
    return rows


def steady_decode(engine: Any, s: GpuCheckSettings) -> float:
    """Admit `s.batch` prompts of `s.context - 1` tokens, wait until all decode, then time
    `s.steps` steps: seconds per step, every request decoding throughout (asserted)."""
    from core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens(s), temperature=0.0, ignore_eos=True)
    for p in _prompts(s.batch, s.context - 1, s.vocab, seed=3):
        engine.add_request(p, params)
    sc, admitting = engine.scheduler, 0
    engine.step()  # takes the requests in
    while sc.waiting or not all(r.is_decoding for r in sc.running):
        engine.step()
        admitting += 1
    assert admitting <= admission_steps(s), f"admission took {admitting} steps"
    for _ in range(WARM_STEPS):
        engine.step()
    sync = torch.cuda.synchronize if engine.config.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(s.steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - t0) / s.steps
    assert len(sc.running) == s.batch, f"{len(sc.running)} of {s.batch} requests decoded throughout"
    return step_s


def kv_bytes_read(spec: Any, batch: int, context: int) -> int:
    """K and V bytes one decode step reads (bf16): full layers every key, SWA layers the window."""
    from worker.models.spec import LayerKind

    total = 0
    for kind in spec.layer_kinds:
        shape = spec.shape(kind)
        per_token = shape.num_kv_heads * (shape.head_dim + shape.v_head_dim) * 2
        keys = context if kind is LayerKind.FULL else min(context, (spec.window or context) + 1)
        total += per_token * keys * batch
    return total


STEPS = (
    Step("kernels", ("cuda", "flashinfer"), lambda ctx: kernel_parity(ctx)),
    Step("greedy", ("cuda", "flashinfer"), greedy_parity),
    Step("graph-logits", ("cuda", "flashinfer"), graph_logits),
    Step("overlap", ("cuda", "flashinfer"), overlap_parity),
    Step("quantized", ("cuda",), quantized_parity),
    Step("bandwidth", ("cuda", "flashinfer"), bandwidth),
)


def run_steps(s: GpuCheckSettings, have: dict[str, bool], only: tuple[str, ...] = (),
              out: Path | None = None) -> list[Row]:  # fmt: skip
    """Every step in order: skipped with its reason, or run (a failure is a FAIL row with its
    exception; the others still run). The table is rewritten under `out` after each step."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="swaserve-gpu-check-") as tmp:
        ctx = Context(s, Path(tmp))
        for step in STEPS:
            if only and step.name not in only:
                continue
            why = skip_reason(step, have)
            if why is not None:
                rows.append(Row(step.name, f"skipped: {why}", None, skipped=True))
            else:
                t0 = time.perf_counter()
                try:
                    rows += step.run(ctx)
                except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
                    traceback.print_exc()
                    rows.append(Row(step.name, f"FAILED: {type(exc).__name__}: {exc}", False))
                print(f"gpu-check: {step.name} done in {time.perf_counter() - t0:.0f} s", flush=True)
            if out is not None:
                write(out, rows, have)
    return rows


def report(rows: list[Row]) -> str:
    def mark(r: Row) -> str:
        return "skipped" if r.skipped else {True: "pass", False: "FAIL", None: ""}[r.ok]

    return markdown_table(["check", "result", ""], [[r.check, r.result, mark(r)] for r in rows])


def describe(have: dict[str, bool]) -> str:
    """The machine and versions the table was measured on."""
    parts = [f"torch {torch.__version__}"]
    if have["cuda"]:
        parts.insert(0, torch.cuda.get_device_name())
        parts.append(f"CUDA {torch.version.cuda}")
    if have["flashinfer"]:
        import flashinfer

        parts.append(f"flashinfer {flashinfer.__version__}")
    return ", ".join(parts)


def write(out: Path, rows: list[Row], have: dict[str, bool]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    head = f"gpu-check on {describe(have)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    (out / "gpu_check.md").write_text(f"{head}\n\n{report(rows)}\n")
    (out / "gpu_check.json").write_text(json.dumps({"machine": describe(have), "rows": [asdict(r) for r in rows]}, indent=1))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GpuCheckSettings()
    parser.add_argument("--hidden", type=int, default=d.hidden, help="the random model's hidden size")
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--batch", type=int, default=d.batch, help="bandwidth: decoding requests")
    parser.add_argument("--context", type=int, default=d.context, help="bandwidth: tokens per request")
    parser.add_argument("--steps", type=int, default=d.steps, help="bandwidth: timed decode steps")
    parser.add_argument("--step-tokens", type=int, default=d.step_tokens,
                        help="max_num_batched_tokens of the engines")  # fmt: skip
    parser.add_argument("--only", nargs="*", default=[], choices=[st.name for st in STEPS],
                        help="run these steps only (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="write gpu_check.md and gpu_check.json here (default: $OUT if set)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    s = GpuCheckSettings(hidden=args.hidden, layers=args.layers, batch=args.batch,
                         context=args.context, steps=args.steps, step_tokens=args.step_tokens)  # fmt: skip
    have = environment()
    print(f"gpu-check on {describe(have)}", flush=True)
    rows = run_steps(s, have, tuple(args.only), args.out)
    print(report(rows))
    return 1 if any(r.ok is False for r in rows) else 0

"""`swaserve bench gpu-check`: the GPU paths in one run, one table (docs/design.md §18.2).

Written to be run in one go when a CUDA machine is lent; on a machine without CUDA it prints
"no CUDA" and exits 0 having run nothing (nothing is reported as passed).

1. **kernels**: FlashInfer vs the torch backend on the same random pool and mixed batches
   (decodes + prefill chunks; full/GQA, window, sinks), the FULL view both flat and paged (the
   page indices gathered on the device from a page table): max |difference|, bf16 tolerance.
2. **greedy**: a random dense Gemma-3-style model (5 sliding : 1 full layers, bf16) saved with
   transformers, served by three engines on the same prompts: torch backend, FlashInfer eager,
   FlashInfer with decode CUDA graphs. Greedy tokens agreeing before the first divergence
   (bf16 near-ties may flip late), and how many decode steps replayed a graph.
3. **graph vs eager logits**: one decode batch run through the graph and eagerly on the same
   inputs (the same KV written twice): max |logit difference|.
4. **bandwidth**: B requests at context C decode N steps (synchronised, wall time per step),
   eager and with graphs; every request is admitted before the first one can finish (each
   asks for more tokens than the steps that admit the others take); achieved GB/s = (weight bytes + KV bytes the step reads) / step time,
   KV read = per request, full layers x context + SWA layers x min(context, window + 1),
   K and V. Compare with the device's peak (H100/H200: 3.35/4.8 TB/s).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness import markdown_table

NO_CUDA = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing was run"
ATOL = 2e-2
DTYPE = torch.bfloat16


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
    ok: bool | None  # None: a measurement, not a pass/fail


def cuda_ready() -> str | None:
    """Why the GPU check cannot run here, or None."""
    if not torch.cuda.is_available():
        return NO_CUDA
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "gpu-check: flashinfer is not installed (pip install -e '.[gpu]'); nothing was run"
    return None


# ---- 1. kernels ---------------------------------------------------------------------------------
def kernel_parity(seed: int = 0) -> list[Row]:
    from worker.attention.base import AttentionLayer, AttnBatch, KVView
    from worker.attention.flashinfer_backend import FlashInferBackend
    from worker.attention.torch_backend import TorchBackend
    from worker.models.spec import KindShape, LayerKind, ModelSpec

    gen = torch.Generator().manual_seed(seed)
    rows = []
    cases = {  # kind, q heads, kv heads, head dim, window, sinks
        "full GQA": (LayerKind.FULL, 8, 2, 128, 64, False),
        "SWA window": (LayerKind.SWA, 8, 2, 64, 31, False),
        "SWA sinks": (LayerKind.SWA, 8, 2, 64, 31, True),
    }
    q_lens, prefix = [1, 1, 37, 1, 200, 5], [300, 2, 0, 95, 150, 40]
    slots = 4096
    for name, (kind, hq, hkv, d, window, sinks) in cases.items():
        pool = _FakePool(
            torch.randn(slots, hkv, d, generator=gen).to("cuda", DTYPE),
            torch.randn(slots, hkv, d, generator=gen).to("cuda", DTYPE),
        )
        perm = (torch.randperm(slots - 1, generator=gen) + 1).cuda()
        seq = [p + q for p, q in zip(prefix, q_lens)]
        table = torch.zeros(len(seq), max(seq), dtype=torch.int32, device="cuda")
        parts, starts, used = [], [], 0
        for i, n in enumerate(seq):
            table[i, :n] = perm[used : used + n].int()
            used += n
            start = 0 if kind is LayerKind.FULL else max(0, prefix[i] - window)
            starts.append(start)
            parts.append(table[i, start:n].long())
        indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0).cuda()
        flat = KVView(torch.cat(parts), indptr, tuple(starts))
        views = {"flat": flat}
        if kind is LayerKind.FULL:
            rows_dev = torch.arange(len(seq), device="cuda")
            views["paged"] = KVView.paged(table, tuple(range(len(seq))), rows_dev, (0,) * len(seq), tuple(seq))
        positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix, q_lens)]).cuda()
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to("cuda", DTYPE)
        sink = (torch.randn(hq, generator=gen) * 2).cuda() if sinks else None
        layer = AttentionLayer(0, kind, hq, hkv, d, d, scaling=d**-0.5)
        spec = ModelSpec("check", (LayerKind.FULL, LayerKind.SWA), window, KindShape(hq, hkv, d, d, sinks),
                         KindShape(hq, hkv, d, d, sinks), 256, 64, 4096)  # fmt: skip
        fi, ref = FlashInferBackend(pool, spec, "cuda"), TorchBackend(pool)  # type: ignore[arg-type]
        for form, view in views.items():
            batch = AttnBatch(tuple(q_lens), tuple(seq), positions, {kind: view}, window)
            got = fi.forward(layer, q, fi.plan(batch), sink)
            want = ref.forward(layer, q, ref.plan(batch), sink)
            diff = float((got.float() - want.float()).abs().max())
            rows.append(Row(f"FlashInfer vs torch: {name}, {form} view", f"max |diff| {diff:.4f}", diff < ATOL * 4))
    return rows


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
                  overlap: str = "auto", device: str = "cuda") -> Any:  # fmt: skip
    from worker.config import EngineConfig

    running = max(batch, s.prompts)
    max_len = s.context + new_tokens(s) + 64
    return EngineConfig(
        model=str(path), dtype="bfloat16", device=device, attention_backend=backend,
        cuda_graphs=graphs, overlap_schedule=overlap, max_running_requests=running,
        max_num_batched_tokens=s.step_tokens, max_model_len=max_len,
        max_total_tokens=running * (max_len + 64), swa_full_tokens_ratio=s.swa_ratio,
    )  # fmt: skip


def _engine(path: Path, backend: str, graphs: str, s: GpuCheckSettings, batch: int,
            overlap: str = "auto") -> Any:  # fmt: skip
    from worker.engine.engine import Engine

    return Engine(engine_config(path, backend, graphs, s, batch, overlap))


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


def greedy_parity(path: Path, s: GpuCheckSettings) -> list[Row]:
    from core.sampling_params import SamplingParams

    prompts = _prompts(s.prompts, 200, s.vocab)
    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    outs, replays = {}, 0
    for label, backend, graphs in (("torch", "torch", "off"), ("flashinfer", "flashinfer", "off"),
                                   ("flashinfer+graphs", "flashinfer", "auto")):  # fmt: skip
        engine = _engine(path, backend, graphs, s, s.prompts)
        outs[label] = [o.token_ids for o in engine.generate(prompts, params)]
        graphs_obj = getattr(engine.runner, "graphs", None)
        if graphs_obj is not None:
            replays = graphs_obj.replays
        engine.close()
        del engine
        torch.cuda.empty_cache()
    rows = []
    for a, b in (("torch", "flashinfer"), ("flashinfer", "flashinfer+graphs")):
        same = [_agree(x, y) for x, y in zip(outs[a], outs[b])]
        # bf16: a near-tie may flip late (the graph wrappers split the keys differently too)
        ok = min(same) >= min(8, s.new_tokens)
        rows.append(Row(f"greedy {a} vs {b}", f"agree {same} of {s.new_tokens} tokens", ok))
    rows.append(Row("decode steps served by a graph", str(replays), replays > 0))
    return rows


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def graph_logits(path: Path, s: GpuCheckSettings) -> list[Row]:

    # NOTE: overlap off: this check schedules and runs a batch itself, outside `step`, which
    # must leave no forward in flight (with overlap, the decodes' inputs would still be sampling).
    engine = _engine(path, "flashinfer", "auto", s, s.prompts, overlap="off")
    if engine.runner.graphs is None:
        engine.close()
        return [Row("graph vs eager logits", "no graphs captured (see the log)", False)]
    n, diff, same = graph_vs_eager(engine, _prompts(s.prompts, 300, s.vocab, seed=2))
    engine.close()
    return [Row(f"graph vs eager logits ({n} decodes)", f"max |diff| {diff:.4f}, argmax equal {same}", same)]


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


def bandwidth(path: Path, s: GpuCheckSettings) -> list[Row]:
    rows = []
    for graphs in ("off", "auto"):
        engine = _engine(path, "flashinfer", graphs, s, s.batch)
        spec = engine.spec
        step_s = steady_decode(engine, s)
        weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        kv = kv_bytes_read(spec, s.batch, s.context + 5)
        gbs = (weights + kv) / step_s / 1e9
        label = "graphs" if graphs == "auto" else "eager"
        rows.append(Row(
            f"decode bandwidth, {label}, batch {s.batch} x {s.context} context",
            f"{step_s * 1e3:.2f} ms/step, {(weights + kv) / 1e9:.2f} GB read, {gbs:,.0f} GB/s",
            None,
        ))  # fmt: skip
        engine.close()
        del engine
        torch.cuda.empty_cache()
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


def run_checks(s: GpuCheckSettings) -> list[Row]:
    rows = kernel_parity()
    with tempfile.TemporaryDirectory(prefix="swaserve-gpu-check-") as tmp:
        path = dense_model_dir(Path(tmp), s)
        for check in (greedy_parity, graph_logits, bandwidth):
            try:
                rows += check(path, s)
            except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
                rows.append(Row(check.__name__, f"FAILED: {type(exc).__name__}: {exc}", False))
    return rows


def report(rows: list[Row]) -> str:
    mark = {True: "pass", False: "FAIL", None: ""}
    return markdown_table(["check", "result", ""], [[r.check, r.result, mark[r.ok]] for r in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GpuCheckSettings()
    parser.add_argument("--hidden", type=int, default=d.hidden, help="the random model's hidden size")
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--batch", type=int, default=d.batch, help="bandwidth: decoding requests")
    parser.add_argument("--context", type=int, default=d.context, help="bandwidth: tokens per request")
    parser.add_argument("--steps", type=int, default=d.steps, help="bandwidth: timed decode steps")
    parser.add_argument("--step-tokens", type=int, default=d.step_tokens,
                        help="max_num_batched_tokens of the engines")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    why = cuda_ready()
    if why is not None:
        print(why)
        return 0
    s = GpuCheckSettings(hidden=args.hidden, layers=args.layers, batch=args.batch,
                         context=args.context, steps=args.steps, step_tokens=args.step_tokens)  # fmt: skip
    print(f"gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    rows = run_checks(s)
    print(report(rows))
    return 1 if any(r.ok is False for r in rows) else 0

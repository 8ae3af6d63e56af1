"""`swaserve bench host-step`: host work per decode step, with nothing computed.

The real engine (scheduler, hybrid allocator, radix cache, stop checks, stream deltas) runs over
`HostStepRunner`, which does the model runner's host half — `prepare_inputs`, the one packed
tensor of a step — and writes the page-table entries into a CPU page table the way `execute`
does on the device, then samples token 1 for every row. No model, no KV buffers: only what the
host spends per step, which on a GPU is time the device waits unless it is hidden.

Per (batch B, context C) on a model preset's layer plan (default GPT-OSS-120B: 18 full and 18
SWA layers, window 127): B requests of C − 1 prompt tokens (distinct first tokens, so no prefix
is shared) are prefilled (one request per step), then `warmup` decode steps run, then `steps`
decode steps are timed one by one; the table reports the median µs per step of the whole
`Engine.step`, the runner's share of it, and the variation from the smallest to the largest
context at each batch size. Times are CPU time of the process (`time.process_time`), so other
jobs on a shared machine do not count; the wall-clock median is printed beside them. The pools hold B × (C + steps) tokens. One torch thread by default
(`--threads`): the host half of a GPU engine does no parallel CPU math, and torch's intra-op
threads on a shared machine turn a 32K-entry copy into milliseconds of waiting.

Two paths are measured in the same process, alternately per cell:

- `paged`: requests carry page-table rows; a step sends only new entries (docs/design.md §18.1);
- `flat`: the same batches with the rows dropped, so the runner builds the FULL view from every
  request's whole table each step — the path every step took before page tables (O(tokens)).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.harness import markdown_table
from bench.machine import machine_info
from core.sampling_params import SamplingParams
from worker.assembly.parts import EngineParts
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.kv.hybrid_allocator import HybridAllocator
from worker.models.spec import ModelSpec
from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.model_runner import DeviceTable, prepare_inputs
from worker.runner.sampler import SampleOutput, SampleRow

PATHS = ("paged", "flat")


@dataclass(frozen=True)
class HostStepSettings:
    model: str = "gpt-oss-120b"
    batches: tuple[int, ...] = (1, 64, 256)
    contexts: tuple[int, ...] = (1024, 8192, 32768)
    steps: int = 20
    warmup: int = 3
    page_size: int = 16
    paths: tuple[str, ...] = PATHS
    threads: int = 1  # torch intra-op threads (None-like 0: torch's default)


@dataclass(frozen=True)
class Cell:
    path: str
    batch: int
    context: int
    step_us: float  # median CPU µs of one Engine.step (this process; other jobs do not count)
    runner_us: float  # median CPU µs of the runner's host half within it
    full_view_entries: int  # FULL key slots the step's inputs carried (flat) or wrote (paged)
    wall_us: float = 0.0  # median wall µs of one Engine.step (moves with the machine's load)


class HostStepRunner:
    """A `Runner` that does the host half of a step and computes nothing (module docstring)."""

    def __init__(self, spec: ModelSpec, allocator: HybridAllocator, path: str, width: int) -> None:
        self.spec, self.allocator, self.path = spec, allocator, path
        self.table = DeviceTable(1, width, torch.device("cpu"))
        self.last_runner_s = 0.0
        self.last_entries = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.path == "flat":  # (not timed: the rows are dropped before the clock starts)
            batch = ForwardBatch(tuple(dataclasses.replace(r, row=None) for r in batch.reqs))
        t0 = time.process_time()
        host = prepare_inputs(batch, self.spec, self.allocator)
        if host.full_rows is not None:
            self.table.ensure(max(host.full_rows) + 1, host.table_width)
            p = host.packed
            self.table.write(
                host.part(p, "sync_row"), host.part(p, "sync_col"), host.part(p, "sync_val")
            )
        self.last_runner_s = time.process_time() - t0
        key = "sync_val" if host.full_rows is not None else "full_idx"
        self.last_entries = host.spans[key][1]
        return ForwardOutput(torch.empty(host.num_logit_rows, 0))

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        n = len(rows)
        return SampleOutput([1] * n, [None] * n, [None] * n)


def build_engine(
    spec: ModelSpec, batch: int, context: int, s: HostStepSettings, path: str
) -> tuple[Engine, HostStepRunner]:
    """The real engine over pools that hold `batch` requests of `context + steps` tokens."""
    from core.geometry import Geometry
    from worker.cache import create_cache
    from worker.kv.memory_plan import plan_pools

    P = s.page_size
    max_len = context + _new_tokens(batch, s) + 2 * P
    per_req = -(-max_len // P) * P
    window = spec.window or 0
    # SWA: every request's window and decode headroom plus one prompt (prefills run one at a
    # time); the full pool holds every request (and at least the SWA pool: the ratio is <= 1).
    swa = batch * (window + 2 * 128 + 4 * P) + per_req
    full = max(batch * per_req, swa) + P
    config = EngineConfig(
        page_size=P, max_total_tokens=full, swa_full_tokens_ratio=min(1.0, swa / full),
        chunked_prefill_size=context, max_running_requests=batch,
    )  # fmt: skip
    plan = plan_pools(
        spec, page_size=P, dtype_bytes=2, swa_full_tokens_ratio=config.swa_full_tokens_ratio,
        max_total_tokens=full,
    )  # fmt: skip
    allocator = HybridAllocator(plan.full_tokens, plan.swa_tokens, P, plan.hybrid)
    cache = create_cache(allocator, Geometry(P, spec.window if plan.hybrid else None, len(spec.swa_layer_ids)))
    runner = HostStepRunner(spec, allocator, path, max_len)
    parts = EngineParts(spec, allocator, cache, runner, max_len, plan=plan)
    return Engine(config, parts), runner


def _new_tokens(batch: int, s: HostStepSettings) -> int:
    """Tokens each request generates: the first ones decode while the later ones prefill."""
    return batch + s.warmup + s.steps + 4


def measure(spec: ModelSpec, batch: int, context: int, s: HostStepSettings, path: str) -> Cell:
    engine, runner = build_engine(spec, batch, context, s, path)
    params = SamplingParams(max_tokens=_new_tokens(batch, s), ignore_eos=True)
    vocab = spec.vocab_size
    for i in range(batch):
        engine.add_request([2 + i % (vocab - 2)] + [7] * (context - 2), params)
    sc = engine.scheduler
    engine.step()  # takes the requests in
    while sc.waiting or not all(r.is_decoding for r in sc.running):
        engine.step()  # prefill, one request per step
    for _ in range(s.warmup):
        engine.step()
    step_s, runner_s, wall_s = [], [], []
    for _ in range(s.steps):
        t0, w0 = time.process_time(), time.perf_counter()
        engine.step()
        step_s.append(time.process_time() - t0)
        wall_s.append(time.perf_counter() - w0)
        runner_s.append(runner.last_runner_s)
    assert len(sc.running) == batch, f"{len(sc.running)} of {batch} requests decode: {sc.counters}"
    engine.check_integrity()
    engine.close()
    return Cell(
        path, batch, context, statistics.median(step_s) * 1e6, statistics.median(runner_s) * 1e6,
        runner.last_entries, statistics.median(wall_s) * 1e6,
    )  # fmt: skip


def run_cells(spec: ModelSpec, s: HostStepSettings) -> list[Cell]:
    cells = []
    for b in s.batches:
        for c in s.contexts:
            for path in s.paths:  # alternated per cell: load changes hit both paths alike
                cells.append(measure(spec, b, c, s, path))
    return cells


def variation(cells: list[Cell], path: str, batch: int) -> float | None:
    """(largest-context CPU µs) / (smallest-context CPU µs) − 1, for one path and batch."""
    row = sorted((c for c in cells if c.path == path and c.batch == batch), key=lambda c: c.context)
    return None if len(row) < 2 else row[-1].step_us / row[0].step_us - 1


def report(cells: list[Cell], s: HostStepSettings) -> str:
    ctx = [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in s.contexts]
    headers = ["path", "batch", *(f"{c}: CPU µs/step (runner) wall" for c in ctx), f"{ctx[0]}→{ctx[-1]}"]
    rows = []
    for path in s.paths:
        for b in s.batches:
            by_ctx = {c.context: c for c in cells if c.path == path and c.batch == b}
            v = variation(cells, path, b)
            rows.append([
                path, b,
                *(f"{by_ctx[c].step_us:,.0f} ({by_ctx[c].runner_us:,.0f}) {by_ctx[c].wall_us:,.0f}"
                  for c in s.contexts),
                "" if v is None else f"{v:+.0%}",
            ])  # fmt: skip
    return markdown_table(headers, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = HostStepSettings()
    parser.add_argument("--model", default=d.model, help=f"a model preset of bench/configs (default {d.model})")
    parser.add_argument("--batches", nargs="+", type=int, default=list(d.batches))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(d.contexts))
    parser.add_argument("--steps", type=int, default=d.steps, help="timed decode steps per cell")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(d.paths))
    parser.add_argument(
        "--threads", type=int, default=d.threads,
        help="torch intra-op threads (default 1: tensors of >= 32K entries otherwise fork onto "
        "every core, which on a loaded machine stalls for milliseconds; 0: torch's default)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from bench.routing.stacks import preset_spec

    s = HostStepSettings(
        args.model, tuple(args.batches), tuple(args.contexts), args.steps, args.warmup,
        paths=tuple(args.paths), threads=args.threads,
    )  # fmt: skip
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    spec = preset_spec(s.model)
    print(
        f"host work per decode step, {s.model} layer plan, median of {s.steps} steps, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(machine_info().describe())
    cells = run_cells(spec, s)
    print(report(cells, s))
    print(f"(after the runs) {machine_info().describe()}")
    return 0

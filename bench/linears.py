"""`swaserve bench linears`: one forward's linear products at small row counts, per weight layout.

    swaserve bench linears [--rows 1 2 4 6 8 16 32 64] [--threads 1] [--repeats 20]

The linears of `bench.compare.model`'s 46M Gemma-3 (per layer: q/k/v fused 512 → 768, o
512 → 512, gate/up fused 512 → 4,096, down 2,048 → 512; 12 layers), float32, random weights,
multiplied by `rows` random rows in three layouts, back to back per row count:

    packed   oneDNN's blocked layout (`mkldnn._linear_pointwise`, what `compile: auto` packs)
    panels   the small-step kernel over 16-column panels (`small_step_kernel`, docs/design.md §19)
    plain    MKL's `rows @ Wᵀ` on a contiguous transposed copy

It prints ms per forward's linears (the median of 5 timings of `--repeats` forwards, this
thread's CPU time on one torch thread, wall time on more), and panels ÷ packed. The kernel is
checked against `rows @ Wᵀ` first. Which rows take the panels in an engine is
`worker.models.packed.panel_rows_max` (64 on one torch thread, 6 on more).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench.compare.model import CompareModelShape
from bench.harness import markdown_table
from bench.machine import load_average


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)


def run(args: argparse.Namespace) -> int:
    import torch

    from worker.models.panel_kernel import pack_panels, panel_kernel, panel_linear

    torch.set_num_threads(args.threads)
    kernel = panel_kernel()
    if kernel is None:
        print("the small-step kernel did not build here (see the log): nothing to compare")
        return 1
    s = CompareModelShape()
    shapes = [((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), (s.hidden, s.heads * s.head_dim),
              (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) / i**0.5 for o, i in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [pack_panels(w) for w in weights]
    plain = [w.t().contiguous() for w in weights]
    layouts: dict[str, Callable[[int, torch.Tensor], torch.Tensor]] = {
        "packed": lambda j, x: torch.ops.mkldnn._linear_pointwise(x, packed[j], None, "none", [], ""),
        "panels": lambda j, x: panel_linear(kernel, x, panels[j], None, shapes[j][0]),
        "plain": lambda j, x: torch.mm(x, plain[j]),
    }
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    before = load_average()
    rows_out = []
    for m in args.rows:
        xs = [torch.randn(m, i, generator=gen) for _, i in shapes]
        for j, x in enumerate(xs):
            torch.testing.assert_close(layouts["panels"](j, x), x @ weights[j].t(), rtol=1e-4, atol=1e-4)
        ms = {}
        for name, fn in layouts.items():
            timings = []
            for _ in range(5):
                t0 = clock()
                for _ in range(args.repeats):
                    for j, x in enumerate(xs):
                        fn(j, x)
                timings.append((clock() - t0) / args.repeats * s.layers * 1e3)
            ms[name] = statistics.median(timings)
        rows_out.append([m, f"{ms['packed']:.1f}", f"{ms['panels']:.1f}", f"{ms['plain']:.1f}",
                         f"{ms['panels'] / ms['packed']:.2f}x"])  # fmt: skip
        print(f"{m:>4} rows: packed {ms['packed']:.1f} ms, panels {ms['panels']:.1f}, plain {ms['plain']:.1f}", flush=True)
    print()
    print(f"46M Gemma-3 linears per forward ({s.layers} layers), ms, {args.threads} torch thread(s), "
          f"load {before:.2f} -> {load_average():.2f}")  # fmt: skip
    print(markdown_table(["rows", "packed", "panels", "plain", "panels ÷ packed"], rows_out))
    return 0

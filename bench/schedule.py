"""`swaserve bench schedule`: offline throughput of the step budget and overlap scheduling.

    swaserve bench schedule [--batches 1 8 32] [--rounds 2] [--input-len 256] [--output-len 64]

`Engine.generate` on `bench.compare.model`'s random Gemma-3 (46 M parameters, float32) with one
torch compute thread, at each batch size (that many random prompts at once, every one
generating exactly `--output-len` tokens), under four configurations built in one process and
run back to back, the order rotating between rounds so that load drifts hit all of them:

    old budget      chunked_prefill_size 512 on top of the decodes (the former default)
    budget          max_num_batched_tokens at its default (2048, docs/design.md §11.7), decodes included
    old + overlap   / budget + overlap: the same with `overlap_schedule: on`

Per configuration and batch it keeps the best round (the quietest moment) and prints output
tokens per second, the mean step time, and ratios against the old budget without overlap; the
1-minute load before and after each run is printed too. For the configurations without overlap
it also prints the host share: the part of the wall time outside the runner's device half
(`ModelRunner.execute`), i.e. the most overlap could hide. Greedy tokens must be equal across the
four configurations (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

CONFIGS: dict[str, dict[str, object]] = {
    "old budget": dict(chunked_prefill_size=512, max_num_batched_tokens=1 << 30, overlap_schedule="off"),
    "budget": dict(overlap_schedule="off"),
    "old + overlap": dict(chunked_prefill_size=512, max_num_batched_tokens=1 << 30, overlap_schedule="on"),
    "budget + overlap": dict(overlap_schedule="on"),
}


@dataclass
class Run:
    seconds: float
    steps: int
    tokens: int
    load_before: float
    load_after: float
    execute_seconds: float = 0.0  # in ModelRunner.execute (inline runs only)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps


def _time_execute(engine: object) -> list[float]:
    """Accumulate the seconds `engine.runner.execute` takes into the returned cell."""
    runner = engine.runner  # type: ignore[attr-defined]
    cell, inner = [0.0], runner.execute

    def timed(*args: object) -> object:
        t = time.perf_counter()
        try:
            return inner(*args)
        finally:
            cell[0] += time.perf_counter() - t

    runner.execute = timed
    return cell


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.compare.model import ensure_compare_model
    from core.sampling_params import SamplingParams
    from worker.config import EngineConfig
    from worker.engine.engine import Engine

    torch.set_num_threads(1)
    model = ensure_compare_model()
    engines = {
        name: Engine(EngineConfig(model=str(model), **over))  # type: ignore[arg-type]
        for name, over in CONFIGS.items()
    }
    device_time = {name: _time_execute(e) for name, e in engines.items() if CONFIGS[name]["overlap_schedule"] == "off"}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = next(iter(engines.values())).spec.vocab_size
    best: dict[tuple[str, int], Run] = {}
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(10, vocab, (batch, args.input_len), generator=gen).tolist()
        for engine in engines.values():  # warm-up: a short run on each engine
            engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
            engine.flush_cache()
        outputs: dict[str, list[list[int]]] = {}
        names = list(CONFIGS)
        for rnd in range(args.rounds):
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                engine = engines[name]
                if name in device_time:
                    device_time[name][0] = 0.0
                steps0, load0, t0 = engine.counters.steps, os.getloadavg()[0], time.perf_counter()
                outs = engine.generate(prompts, params)
                seconds = time.perf_counter() - t0
                engine.flush_cache()  # every round prefills from scratch
                r = Run(seconds, engine.counters.steps - steps0, sum(len(o.token_ids) for o in outs),
                        load0, os.getloadavg()[0], device_time[name][0] if name in device_time else 0.0)  # fmt: skip
                outputs[name] = [o.token_ids for o in outs]
                if (name, batch) not in best or r.seconds < best[name, batch].seconds:
                    best[name, batch] = r
                print(f"batch {batch:>3} round {rnd} {name:<17} {r.tok_s:8.1f} tok/s  "
                      f"{r.step_ms:7.2f} ms/step  {r.steps:4d} steps  load {r.load_before:.2f}->{r.load_after:.2f}",
                      flush=True)  # fmt: skip
        if len({str(v) for v in outputs.values()}) != 1:
            print(f"batch {batch}: greedy tokens differ between configurations")
            return 1
    base = "old budget"
    print("\n| batch | configuration | output tok/s | mean step ms | steps | × old budget | host share | load 1m |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for batch in args.batches:
        for name in CONFIGS:
            r, b = best[name, batch], best[base, batch]
            host = f"{1 - r.execute_seconds / r.seconds:.1%}" if r.execute_seconds else "–"
            print(f"| {batch} | {name} | {r.tok_s:.1f} | {r.step_ms:.2f} | {r.steps} | "
                  f"{r.tok_s / b.tok_s:.2f} | {host} | {r.load_before:.2f}→{r.load_after:.2f} |")  # fmt: skip
    for engine in engines.values():
        engine.close()
    return 0

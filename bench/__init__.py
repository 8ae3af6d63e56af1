"""`swaserve bench` subcommands. Each module has `add_arguments(parser)` and `run(args) -> int`.

- `memory`: pool sizes and admitted concurrency of the dual pools vs one pool (no GPU).
- `engine`: the engine's tokens/s against transformers `generate` on the same model and prompts.
- `cache`: radix cache match/insert/evict operations per second on large trees.
- `routing`: the four routing policies on shared-prefix workloads (simulated cluster; `--real`).
"""

"""`swaserve bench` (`cli.py` names every benchmark). Each is a module with `add_arguments(parser)`
and `run(args) -> int`: a package's `main.py` (`routing/`, `memory/`, `engine/`), one of
`compare/`'s three (vllm-compare, replica-profile, cluster-compare), or a single module (`cache`, `compile`,
`host_step`, `schedule`, `gpu_check`). `harness`, `machine`, `sim_runner` and `configs/` are shared;
`decision_latency` runs as `python -m bench.decision_latency`.
"""

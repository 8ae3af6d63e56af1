"""`swaserve bench` (`cli.py` names every benchmark). Each is a module with `add_arguments(parser)`
and `run(args) -> int`: a package's `main.py` (`routing/`, `memory/`, `engine/`), one of
`compare/`'s three (vllm-compare, replica-profile, cluster-compare), or a single module (`cache`, `compile`,
`host_step`, `schedule`, `gpu_check`; `gpu_carry` and `gpu_device_check.sh` bring the latter to a
lent GPU). `harness`, `machine`, `sim_runner` and `configs/` are shared;
`decision_latency` runs as `python -m bench.decision_latency`.
"""

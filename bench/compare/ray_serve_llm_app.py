"""The peer cluster of `cluster-compare`: Ray Serve LLM, N vLLM-CPU replicas, prefix-affinity routing.

    PEER_VENV/bin/python -P bench/compare/ray_serve_llm_app.py --model DIR --model-id NAME \\
        --port P --metrics-port-file F --replicas 2 --kv-cache-bytes B [--num-cpus 8]

Run by the Ray Serve LLM peer venv's interpreter (`bench.compare.peers.RAY_SERVE_LLM`), never
imported by this repository's code: it imports only Ray (and, inside Ray's replicas, vLLM).
``-P`` keeps this folder off ``sys.path`` (its `model.py`, `client.py`, … would shadow
top-level modules of the same names).

What it deploys is Ray Serve LLM's documented OpenAI app (`build_openai_app`) with one
`LLMConfig`: `accelerator_config` kind ``cpu`` (Ray's CPU backend for vLLM's CPU build),
`num_replicas` replicas behind `PrefixCacheAffinityRouter`, prefix caching on, float32, seed 0
and `kv_cache_memory_bytes` per replica; every other engine and router knob is the default a user
gets. The replicas' environment (`OMP_NUM_THREADS`, `VLLM_CPU_OMP_THREADS_BIND`) is this
process's, passed through the `runtime_env`. Ray's metrics agent serves the engines' vLLM
counters (``ray_vllm_*``) on the port Ray chose, which this writes to ``--metrics-port-file``
(`ray.nodes()`' ``MetricsExportPort``: choosing it needs a private `ray.init` argument).

It prints ``READY`` once `serve.run` returns (the application is running) and shuts Serve and
Ray down on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

PASSED_ENV = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def main() -> None:
    args = _parser().parse_args()
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    port = next(int(n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"])
    Path(args.metrics_port_file).write_text(f"{port}\n")
    llm = LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.model},
        # pydantic validates the mapping into Ray's CPUConfig (not exported by ray.serve.llm)
        accelerator_config={"kind": "cpu"},  # type: ignore[arg-type]
        deployment_config={
            "num_replicas": args.replicas,
            "request_router_config": {"request_router_class": PrefixCacheAffinityRouter},
        },
        engine_kwargs={"dtype": "float32", "seed": 0, "enable_prefix_caching": True,
                       "kv_cache_memory_bytes": args.kv_cache_bytes},  # fmt: skip
        runtime_env={"env_vars": env},
    )
    serve.start(http_options={"host": args.host, "port": args.port})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve.run(build_openai_app({"llm_configs": [llm]}), blocking=False)
    print("READY", flush=True)
    stop.wait()
    serve.shutdown()
    ray.shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Ray Serve LLM: vLLM-CPU replicas behind PrefixCacheAffinityRouter")
    p.add_argument("--model", required=True, help="the model directory")
    p.add_argument("--model-id", required=True, help="the name clients send")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port-file", required=True, help="where to write Ray's metrics port")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, required=True, help="KV bytes of each replica")
    p.add_argument("--num-cpus", type=int, default=8, help="the local Ray cluster's logical CPUs")
    return p


if __name__ == "__main__":
    main()

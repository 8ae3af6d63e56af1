"""Loading an MXFP4 checkpoint holds at most one dequantized shard beyond the model.

A random GPT-OSS checkpoint (~100 MB in bfloat16, one shard per layer) is loaded in a fresh
process; its peak RSS growth over the moment before the load is compared with the model's bytes
plus its largest shard's dequantized bytes. A loader that dequantized the checkpoint before
filling the model (or kept one full bf16 copy) would need about twice the model.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.worker.models.quant_ckpt import GPT_OSS_NOT_CONVERTED, shards_by_layer, write_checkpoint
from worker.models.causal_lm import CausalLM
from worker.models.hf_config import spec_from_hf_config
from worker.models.registry import model_class

REPO = Path(__file__).resolve().parents[3]
SLACK = 8 << 20  # allocator rounding (2 MiB huge pages), the first use of each op's workspace


def _config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
        num_experts_per_tok=2, sliding_window=9, max_position_embeddings=4096,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED},
    )  # fmt: skip


def _write_random_checkpoint(path: Path) -> None:
    config = _config()
    with torch.device("meta"):
        model = model_class(config.model_type)(config, spec_from_hf_config(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = p.shape
            shape = (e, n_out, n_in // 32)
            tensors[name + "_scales"] = torch.randint(
                118, 124, shape, dtype=torch.uint8, generator=gen
            )
            tensors[name + "_blocks"] = torch.randint(
                0, 256, (*shape, 16), dtype=torch.uint8, generator=gen
            )
        else:
            tensors[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
    write_checkpoint(path, config, tensors, shards_by_layer(tensors))


def _status(field: str) -> int:
    """A size from /proc/self/status, in bytes (VmRSS: now; VmHWM: peak since the last reset)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    # NOTE: not getrusage's ru_maxrss: it survives fork + exec, so a child started by a large
    # pytest process reports at least its parent's RSS. "5" resets this mm's VmHWM to VmRSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _largest_dequantized_shard(path: Path, model: CausalLM) -> int:
    params = dict(model.named_parameters())
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    per_file: dict[str, set[str]] = {}
    for stored, file in weight_map.items():
        per_file.setdefault(file, set()).add(stored.removesuffix("_blocks").removesuffix("_scales"))
    return max(sum(params[n].nbytes for n in names) for names in per_file.values())


def measure(path: str) -> dict[str, int]:
    """Run in a fresh process: peak RSS of `load_model` on `path` (bfloat16) and the sizes."""
    from worker.models.hf_config import load_hf_config
    from worker.models.loader import load_model
    from worker.models.quant.mxfp4 import Mxfp4Format

    torch.set_num_threads(1)
    config = load_hf_config(path)
    spec = spec_from_hf_config(config)
    # NOTE: the first model built on the meta device imports torch's meta kernels (~80 MB,
    # once per process); that, and the first use of the dequantization ops, is not the load's.
    with torch.device("meta"):
        model_class(config.model_type)(config, spec)
    warm = torch.empty(1, 64, 1)
    parts = {"blocks": torch.zeros(1, 1, 2, 16, dtype=torch.uint8), "scales": torch.zeros(1, 1, 2, dtype=torch.uint8)}  # fmt: skip
    Mxfp4Format().dequantize_into(warm, parts, "w")
    gc.collect()
    _reset_peak()
    before = _status("VmRSS")
    model = load_model(path, spec, dtype=torch.bfloat16, config=config)
    peak = _status("VmHWM")
    storages = {p.untyped_storage().data_ptr(): p.nbytes for p in model.parameters()}
    shard = _largest_dequantized_shard(Path(path), model)
    return {"before": before, "peak": peak, "model": sum(storages.values()), "shard": shard}


def test_mxfp4_load_peak_rss_is_model_plus_one_shard(tmp_path: Path) -> None:
    """Peak RSS growth while loading stays under model + largest dequantized shard + slack."""
    _write_random_checkpoint(tmp_path / "ckpt")
    code = (
        "import json, sys; from tests.worker.models.test_quantized_memory import measure; "
        "print(json.dumps(measure(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")], cwd=REPO, capture_output=True,
        text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    growth, mib = m["peak"] - m["before"], 1 << 20
    figures = (
        f"peak growth {growth / mib:.1f} MiB; model {m['model'] / mib:.1f} MiB, "
        f"largest shard dequantized {m['shard'] / mib:.1f} MiB"
    )
    print(figures)
    assert growth >= 0.9 * m["model"], f"the measurement misses the model: {figures}"
    assert growth <= m["model"] + m["shard"] + SLACK, figures

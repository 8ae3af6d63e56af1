"""Where GPT-OSS-120B and MiMo-V2-Flash fit on H200s and H100s (README "On GPUs").

Weight bytes are counted tensor by tensor from the real configs (`bench/configs/`) for both
settings of `quantized_weights`: **dequantize** (the default: quantized checkpoints become bf16
while loading, docs/design.md §16) and **keep** (the experts stay as published: GPT-OSS's MXFP4,
4-bit values with one E8M0 scale per 32, 0.53125 bytes a weight, its hidden and intermediate
sizes (2880) padded to 2944 for the fused SM90 kernel that H100s and H200s run; MiMo-V2-Flash's block FP8, 1
byte a weight and one float32 scale per 128x128 block, its attention and dense-MLP linears too
on one GPU but bf16 under tensor parallelism; everything else bf16, as `keep` holds it). Tensor parallelism over N GPUs gives each 1/N of the weights (every matrix, the vocabulary
and the experts, packed or not, are split).

KV tokens per GPU: the engine's own plan (`plan_pools`, default `swa_full_tokens_ratio` 0.8,
page 16, bf16 KV) over the budget it would take on CUDA: `GPU_KV_FRACTION` of what is free after
the weights, less `CUDA_RESERVE` for the CUDA context, FlashInfer's workspace, activations, graphs
and `keep`'s per-expert scratch (an allowance: nothing has been measured on a GPU), shared with
the prompt-logprob workspace (`kv_share_of`). The tokens are the full pool's: the most tokens of
context, summed over the requests, one GPU holds (each rank holds every token's KV for its heads).

    python -m bench.gpu_fit        # prints the README's table
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bench.configs import CONFIG_DIR
from worker.models.quant.mxfp4_kernel import PAD

GPUS = {"H200": 143_771 * 2**20, "H100": 81_559 * 2**20}  # total memory nvidia-smi reports
CUDA_RESERVE = 2 * 2**30
MXFP4_BYTES = 0.5 + 1 / 32
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)
PAGE_SIZE = 16


@dataclass(frozen=True)
class Weights:
    """A model's parameters by storage: kept bf16 either way, or quantized as published."""

    bf16: int  # parameters held in bf16 either way
    quantized: int  # expert weights the checkpoint stores quantized (bf16 with `dequantize`)
    quantized_bytes: float  # bytes per such weight as published (with `keep`)
    # Weights the checkpoint stores quantized outside the experts (MiMo's attention and dense
    # MLP): `keep` holds them as stored on one GPU; under tensor parallelism they are bf16 (the
    # sharder splits plain linears, docs/design.md §16).
    dense_quantized: int = 0
    # The expert weights as `keep` holds them on an SM90 GPU (H100, H200): GPT-OSS's fused MXFP4
    # kernel pads hidden and intermediate to multiples of 128 (`mxfp4_kernel.PAD`); 0: unpadded.
    kernel_quantized: int = 0

    @property
    def params(self) -> int:
        return self.bf16 + self.quantized + self.dense_quantized

    def bytes(self, keep_quantized: bool, n: int = 1) -> int:
        """All the weights' bytes, held on one GPU (`n` 1) or split over `n`."""
        if keep_quantized:
            dense = self.quantized_bytes if n == 1 else 2
            experts = self.kernel_quantized or self.quantized
            return int(2 * self.bf16 + self.quantized_bytes * experts + dense * self.dense_quantized)
        return 2 * self.params


def gpt_oss_weights(c: dict[str, Any]) -> Weights:
    """GPT-OSS: attention (biased projections, sinks), a router and E experts per layer."""
    h, hd, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    e, inter, layers, vocab = c["num_local_experts"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, k = heads * hd, kv * hd
    attn = h * q + q + 2 * (h * k + k) + q * h + h + heads  # q, k, v, o (+ biases), sinks
    router = e * h + e
    expert_biases = e * (2 * inter + h)
    experts = e * (h * 2 * inter + inter * h)  # gate_up, down: MXFP4
    hp, ip = (-(-d // PAD) * PAD for d in (h, inter))
    bf16 = layers * (attn + router + expert_biases + 2 * h) + 2 * vocab * h + h
    return Weights(bf16, layers * experts, MXFP4_BYTES, kernel_quantized=layers * e * 3 * hp * ip)


def mimo_weights(c: dict[str, Any]) -> Weights:
    """MiMo-V2-Flash: full and SWA attention of their own shapes, a dense MLP or E experts. Its
    attention and dense-MLP linears are FP8 in the checkpoint too (~2% of the weights):
    `dense_quantized`."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    pattern, moe = c["hybrid_layer_pattern"], c["moe_layer_freq"]
    e, moe_inter, inter = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    fp8 = bf16 = dense = 0
    for i in range(layers):
        swa = pattern[i] == 1
        heads = c["swa_num_attention_heads"] if swa else c["num_attention_heads"]
        kv = c["swa_num_key_value_heads"] if swa else c["num_key_value_heads"]
        dqk = c["swa_head_dim"] if swa else c["head_dim"]
        dv = c["swa_v_head_dim"] if swa else c["v_head_dim"]
        dense += h * heads * dqk + h * kv * (dqk + dv) + heads * dv * h  # q, k, v, o
        bf16 += 2 * h + (heads if swa and c["add_swa_attention_sink_bias"] else 0)
        if moe[i]:
            fp8 += e * 3 * moe_inter * h
            bf16 += e * h + e  # router, its score-correction bias
        else:
            dense += 3 * inter * h
    return Weights(bf16 + 2 * vocab * h + h, fp8, FP8_BLOCK_BYTES, dense)


MODELS = {"gpt-oss-120b": gpt_oss_weights, "mimo-v2-flash": mimo_weights}


def weights_of(model: str) -> Weights:
    return MODELS[model](json.loads((CONFIG_DIR / f"{model}.json").read_text()))


@dataclass(frozen=True)
class Fit:
    model: str
    gpu: str
    n: int
    keep_quantized: bool
    weight_bytes: int  # per GPU
    kv_budget: int  # per GPU; <= 0: the weights leave no room
    kv_tokens: int  # the full pool's tokens (0 when it does not fit)

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0


def fit(model: str, gpu: str, n: int, keep_quantized: bool) -> Fit:
    from worker.assembly.pools import GPU_KV_FRACTION
    from worker.errors import ConfigError
    from worker.kv.memory_plan import kv_share_of, plan_pools
    from worker.models.hf_config import load_spec
    from worker.parallel.shard import shard_spec

    weights = -(-weights_of(model).bytes(keep_quantized, n) // n)
    free = GPUS[gpu] - weights - CUDA_RESERVE
    budget = kv_share_of(int(free * GPU_KV_FRACTION)) if free > 0 else 0
    tokens = 0
    if budget > 0:
        spec = shard_spec(load_spec(CONFIG_DIR / f"{model}.json"), n)
        try:
            tokens = plan_pools(spec, page_size=PAGE_SIZE, dtype_bytes=2, kv_cache_bytes=budget).full_tokens
        except ConfigError:
            tokens = 0  # pools below the admission floor: no fit
    return Fit(model, gpu, n, keep_quantized, weights, budget, tokens)


# The configurations the README states (tensor_parallel_size must divide the heads: 64 both).
LAYOUTS = (
    ("gpt-oss-120b", "H200", 1), ("gpt-oss-120b", "H200", 2), ("gpt-oss-120b", "H100", 1),
    ("gpt-oss-120b", "H100", 4), ("mimo-v2-flash", "H200", 2), ("mimo-v2-flash", "H200", 4),
    ("mimo-v2-flash", "H200", 8),
)  # fmt: skip


def table() -> str:
    """The README's table: per layout, weights per GPU and KV tokens, dequantize vs keep."""
    from bench.harness import markdown_table

    def cell(f: Fit) -> str:
        gb = f"{f.weight_bytes / 1e9:.0f} GB weights"
        return f"{gb}, {f.kv_tokens / 1e3:,.0f}k KV tokens" if f.fits else f"{gb}: does not fit"

    rows = []
    for model, gpu, n in LAYOUTS:
        today, published = fit(model, gpu, n, False), fit(model, gpu, n, True)
        rows.append([model, f"{n} x {gpu}", cell(today), cell(published)])
    head = ["model", "GPUs", "quantized_weights: dequantize (per GPU)", "quantized_weights: keep (per GPU)"]
    return markdown_table(head, rows)


if __name__ == "__main__":
    for name in MODELS:
        w = weights_of(name)
        print(f"{name}: {w.params / 1e9:.1f} B parameters, dequantize {w.bytes(False) / 1e9:.1f} GB, "
              f"keep {w.bytes(True) / 1e9:.1f} GB (one GPU), {w.bytes(True, 2) / 1e9:.1f} GB (split)")  # fmt: skip
    print(table())

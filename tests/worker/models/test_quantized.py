"""Quantized checkpoints: GPT-OSS in MXFP4 and MiMo-V2-Flash in block FP8, written by our own
packers (`quant_ckpt.py`), loaded by transformers with its CPU dequantization (the oracle) and by
us; the dequantized weights are equal and greedy tokens and logits match."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.models.conftest import prompt_of
from tests.worker.models.driver import Driver
from tests.worker.models.hf_tiny import CONFIGS, VOCAB, hf_greedy, randomize
from tests.worker.models.quant_ckpt import (
    GPT_OSS_NOT_CONVERTED,
    fp8_tensors,
    mxfp4_tensors,
    shards_by_layer,
    write_checkpoint,
)
from worker.errors import ConfigError
from worker.models.causal_lm import CausalLM
from worker.models.hf_config import spec_from_hf_config
from worker.models.loader import load_model
from worker.models.quant.fp8 import BlockFp8Format
from worker.models.quant.mxfp4 import Mxfp4Format, dequantize_mxfp4

MAX_NEW = 24
ATOL = 1e-4
FP8_BLOCK = (128, 128)
FP8_NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate", "model.layers.0.self_attn.o_proj"]


@dataclass(frozen=True)
class Case:
    path: Path
    plain: dict[str, torch.Tensor]  # the float32 weights before quantization
    oracle: Any  # transformers' model, dequantized by transformers
    ours: CausalLM


def _saved_state(model: Any, path: Path) -> dict[str, torch.Tensor]:
    """The state dict in checkpoint names (save_pretrained un-fuses MiMo's experts)."""
    model.save_pretrained(path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _build(root: Path, config: Any, arch: str, quantize: Any, hf_quant: Any) -> Case:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(hf, arch, seed=7)
    plain = _saved_state(hf, root / "plain")
    tensors = quantize(plain)
    # Layer 1's parts straddle two shards: the loader must hold the first until the second.
    moves = {n: 3 for n in tensors if n.startswith("model.layers.1.") and n.endswith("scale_inv")}
    moves["model.layers.1.mlp.experts.down_proj_scales"] = 3
    write_checkpoint(root / "quantized", config, tensors, shards_by_layer(tensors, moves))
    oracle = AutoModelForCausalLM.from_pretrained(
        root / "quantized", quantization_config=hf_quant, dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    ours = load_model(root / "quantized", spec_from_hf_config(config))
    return Case(root / "quantized", plain, oracle, ours)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Case:
    from transformers import Mxfp4Config

    config = CONFIGS["gpt_oss"]()
    config.quantization_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": GPT_OSS_NOT_CONVERTED,
    }
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return _build(root, config, "gpt_oss", mxfp4_tensors, Mxfp4Config(dequantize=True))


def _mimo_fp8_config() -> Any:
    from transformers import MiMoV2FlashConfig

    # Every projection is a multiple of 128 wide or narrower than 128: several [128, 128] tiles.
    return MiMoV2FlashConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, v_head_dim=32,
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, sliding_window=17, max_position_embeddings=1024,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": FP8_NOT_CONVERTED,
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def mimo_fp8(tmp_path_factory: pytest.TempPathFactory) -> Case:
    from transformers import FineGrainedFP8Config

    def quantize(plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fp8_tensors(plain, FP8_BLOCK, FP8_NOT_CONVERTED)

    root = tmp_path_factory.mktemp("mimo_fp8")
    hf_quant = FineGrainedFP8Config(dequantize=True, weight_block_size=FP8_BLOCK)
    return _build(root, _mimo_fp8_config(), "mimo_v2_flash", quantize, hf_quant)


def _check_greedy(case: Case, prompt_len: int, chunk: int | None) -> None:
    spec = case.ours.spec
    drv = Driver(spec, case.ours, page_size=4, chunk=chunk)
    seq = drv.add(prompt_of(prompt_len, seed=prompt_len), MAX_NEW)
    drv.run([seq])
    tokens, logits = hf_greedy(case.oracle, seq.prompt, MAX_NEW)
    assert logits.std() > 0.3, "degenerate oracle: logits nearly uniform"
    diff = (torch.stack(seq.logits) - logits).abs().max().item()
    assert seq.out == tokens, f"tokens differ (max logit diff {diff:.2e})"
    assert diff < ATOL, f"max logit diff {diff:.2e}"


@pytest.mark.parametrize("chunk", [None, 5])
def test_gpt_oss_mxfp4_greedy_matches_transformers(gpt_oss_mxfp4: Case, chunk: int | None) -> None:
    """Greedy tokens and logits of the MXFP4 checkpoint match transformers' dequantized model."""
    _check_greedy(gpt_oss_mxfp4, 5 * gpt_oss_mxfp4.ours.spec.window + 3, chunk)


@pytest.mark.parametrize("chunk", [None, 7])
def test_mimo_fp8_greedy_matches_transformers(mimo_fp8: Case, chunk: int | None) -> None:
    """Greedy tokens and logits of the block-FP8 checkpoint match transformers' dequantized model."""
    _check_greedy(mimo_fp8, 4 * mimo_fp8.ours.spec.window + 3, chunk)


def test_mxfp4_experts_equal_transformers_and_differ_from_the_float_weights(
    gpt_oss_mxfp4: Case,
) -> None:
    """Our dequantized experts are transformers' exactly; the float originals are not (so the
    parity above is not vacuous)."""
    ours, theirs = gpt_oss_mxfp4.ours.state_dict(), gpt_oss_mxfp4.oracle.state_dict()
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        assert torch.equal(ours[name], theirs[name]), name
        assert (ours[name] - gpt_oss_mxfp4.plain[name]).abs().max() > 1e-3, name


def test_fp8_weights_equal_transformers_and_not_converted_stay_as_stored(mimo_fp8: Case) -> None:
    """Quantized projections equal transformers' dequantization (experts included: ours per
    expert, theirs fused); a listed module's bf16 tensor loads as stored."""
    ours, theirs = mimo_fp8.ours.state_dict(), mimo_fp8.oracle.state_dict()
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(ours[name], theirs[name])
    assert (ours[name] - mimo_fp8.plain[name]).abs().max() > 1e-4
    gate_up = theirs["model.layers.2.mlp.experts.gate_up_proj"][1]
    assert torch.equal(ours["model.layers.2.mlp.experts.1.gate_proj.weight"], gate_up[:128])
    kept = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(ours[kept], mimo_fp8.plain[kept].to(torch.bfloat16).float())


def test_mxfp4_dequantization_equals_transformers_in_bfloat16() -> None:
    """Random codes and extreme exponents: equal to transformers' own function, float32 and bf16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(90, 160, (3, 8, 4), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0], scales[1, 1, 1] = 1, 254
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 8]
        got = torch.empty(3, 128, 8, dtype=dtype)
        Mxfp4Format().dequantize_into(got, {"blocks": blocks, "scales": scales}, "x")
        assert torch.equal(got, want), dtype
    assert dequantize_mxfp4(blocks, scales).shape == (3, 8, 128)


def test_fp8_partial_tiles_equal_transformers() -> None:
    """A weight that is not a multiple of the tile: edge tiles are partial (ceil grid)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(300, 200, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.01
    want = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
    got = torch.empty(300, 200)
    BlockFp8Format(block=(128, 128)).dequantize_into(
        got, {"weight": weight, "scale_inv": scale}, "w"
    )
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"w: fp8 weight_scale_inv shape \(2, 2\) != \(3, 2\)"):
        BlockFp8Format(block=(128, 128)).dequantize_into(
            got, {"weight": weight, "scale_inv": scale[:2]}, "w"
        )


def test_plan_skips_modules_to_not_convert_and_names_a_missing_part() -> None:
    """Listed modules (regex, prefix or suffix, transformers' rules) are not planned; a marker
    without its sibling is refused by name."""
    fmt = BlockFp8Format(["model.layers.*.self_attn", "lm_head"], block=(128, 128))
    names = {
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight_scale_inv",
        "model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight_scale_inv",
        "lm_head.weight", "lm_head.weight_scale_inv", "model.norm.weight",
    }  # fmt: skip
    plan = fmt.plan(names)
    assert {p.target for p in plan.values()} == {"model.layers.3.mlp.up_proj.weight"}
    with pytest.raises(
        ValueError, match=r"experts.down_proj_blocks is stored but \['model.*_scales"
    ):
        Mxfp4Format().plan({"model.layers.0.mlp.experts.down_proj_blocks"})


def _with_quant(path: Path, tmp_path: Path, quant: dict) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config.quantization_config = quant
    config.save_pretrained(tmp_path)
    for f in path.glob("model*.safetensors*"):
        (tmp_path / f.name).symlink_to(f)
    return tmp_path


def test_unknown_method_is_refused_with_what_is_supported(
    gpt_oss_mxfp4: Case, tmp_path: Path
) -> None:
    """An unknown quant_method names itself and the supported ones, before anything loads."""
    bad = _with_quant(gpt_oss_mxfp4.path, tmp_path, {"quant_method": "awq", "bits": 4})
    with pytest.raises(ConfigError, match=r"'awq' is not supported; supported: fp8 \(.*\); mxfp4"):
        load_model(bad, gpt_oss_mxfp4.ours.spec)


def test_static_fp8_activations_are_refused(mimo_fp8: Case, tmp_path: Path) -> None:
    """Static activation scales would be dropped silently by dequantization: refused instead."""
    quant = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="activation_scheme 'static' is not supported"):
        load_model(_with_quant(mimo_fp8.path, tmp_path, quant), mimo_fp8.ours.spec)


def test_packer_rounds_to_the_nearest_e2m1_value() -> None:
    """The test checkpoints are what a real packer writes: each value is the nearest one its
    block's scale can express, and no block clips."""
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    from tests.worker.models.quant_ckpt import pack_mxfp4

    w = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(2))  # [E, in, out]
    blocks, scales = pack_mxfp4(w)
    got = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
    nearest = (torch.tensor(FP4_VALUES) * step.unsqueeze(-1) - w.unsqueeze(-1)).abs().amin(-1)
    assert torch.allclose((got - w).abs(), nearest, rtol=0, atol=1e-7)
    assert (w.abs() <= 6 * step).all()


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "mimo_fp8"])
def test_kept_experts_give_the_dequantized_paths_tokens_and_logits(name: str, request: pytest.FixtureRequest) -> None:
    """`keep_quantized`: the packed weights stay packed (their modules swapped, fewer bytes held),
    each dequantized when it runs into the same values the load-time path writes, so greedy
    tokens and logits equal that path's exactly, and transformers' within tolerance."""
    from worker.assembly.host import active_parameters
    from worker.models.moe import MoEBlock
    from worker.models.quant.resident import Fp8Linear, Mxfp4Experts, stored_bytes

    case: Case = request.getfixturevalue(name)
    kept = load_model(case.path, case.ours.spec, keep_quantized=True)
    swapped = [m for m in kept.modules() if isinstance(m, (Mxfp4Experts, Fp8Linear))]
    blocks = [m for m in kept.modules() if isinstance(m, MoEBlock)]
    in_experts = [m for b in blocks for m in b.modules() if isinstance(m, (Mxfp4Experts, Fp8Linear))]
    per_block = 1 if name == "gpt_oss_mxfp4" else 3 * case.oracle.config.n_routed_experts
    assert blocks and len(in_experts) == per_block * len(blocks)  # every expert of every MoE layer
    # Every weight the checkpoint stores quantized is held as stored (MiMo: attention and the
    # dense MLP too); a listed module (layer 0's o_proj) stays a plain linear.
    stored = {k for f in case.path.glob("*.safetensors") for k in load_file(f)}
    held = kept.state_dict()
    quantized = {n for n in stored if n.endswith(("_scale_inv", "_scales"))}
    assert quantized and quantized <= set(held)
    if name == "mimo_fp8":
        assert len(swapped) == len(quantized) > len(in_experts)
        assert all(held[n.removesuffix("_scale_inv")].dtype == torch.float8_e4m3fn for n in quantized)
        assert type(kept.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    packed = sum(m.weight_numel() for m in swapped)
    per_weight = 0.5 + 1 / 32 if name == "gpt_oss_mxfp4" else 1.0
    saved = stored_bytes(case.ours) - stored_bytes(kept)
    assert saved == pytest.approx(packed * (4 - per_weight), rel=0.01)  # float32 -> packed (+ scales)
    assert active_parameters(kept) == active_parameters(case.ours)  # packed weights still count
    runs = []
    for model in (case.ours, kept):
        drv = Driver(model.spec, model, page_size=4, chunk=5)
        seq = drv.add(prompt_of(3 * model.spec.window + 1, seed=11), MAX_NEW)
        drv.run([seq])
        runs.append((seq.out, torch.stack(seq.logits)))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1]), "kept and dequantized-at-load logits differ"
    _check_greedy(Case(case.path, case.plain, case.oracle, kept), 2 * kept.spec.window + 5, None)


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "mimo_fp8"])
def test_engine_quantized_weights_keep_equals_dequantize(name: str, request: pytest.FixtureRequest) -> None:
    """The engine knob end to end (weights packed for oneDNN by `compile: auto` around the kept
    experts): the same greedy tokens either way."""
    from core.sampling_params import SamplingParams
    from worker.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.models.quant.resident import Fp8Linear, Mxfp4Experts

    case: Case = request.getfixturevalue(name)
    prompts = [prompt_of(n, seed=n) for n in (9, 2 * case.ours.spec.window + 3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("dequantize", "keep"):
        engine = Engine(EngineConfig(model=str(case.path), quantized_weights=mode, max_total_tokens=1024))
        try:
            packed = any(isinstance(m, (Mxfp4Experts, Fp8Linear)) for m in engine.runner.model.modules())
            assert packed is (mode == "keep")
            outs[mode] = [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.close()
    assert outs["keep"] == outs["dequantize"]


def test_kept_fp8_linear_compiles_as_one_opaque_op_with_the_eager_result(mimo_fp8: Case) -> None:
    """Under `torch.compile` a kept FP8 linear (attention, dense MLP) is the opaque
    ``swaserve::fp8_linear`` op: one graph, no break, the eager product exactly."""
    from worker.models.quant.resident import Fp8Linear

    kept = load_model(mimo_fp8.path, mimo_fp8.ours.spec, keep_quantized=True)
    q = kept.model.layers[1].self_attn.q_proj
    assert isinstance(q, Fp8Linear)
    x = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(q)(x)
    assert explained.graph_break_count == 0
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.swaserve.fp8_linear in ops or torch.ops.swaserve.fp8_linear.default in ops
    compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), q(x))
    w = mimo_fp8.ours.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(q(x), torch.nn.functional.linear(x, w))


def test_under_tensor_parallelism_only_experts_are_kept(mimo_fp8: Case) -> None:
    """`dense=False` (tensor parallelism: the sharder splits plain linears): the FP8 expert
    linears are swapped, attention and the dense MLP stay plain linears."""
    from worker.models.hf_config import load_hf_config
    from worker.models.loader import _shard_files, _skipped, _stored_names
    from worker.models.quant import quant_format
    from worker.models.quant.resident import Fp8Linear, keep_quantized_modules
    from worker.models.registry import model_class

    config = load_hf_config(mimo_fp8.path)
    quant = quant_format(config)
    assert quant is not None
    with torch.device("meta"):
        model = model_class(config.model_type)(config, mimo_fp8.ours.spec)
    stored = _stored_names(_shard_files(mimo_fp8.path), model)
    names = {n for s, n in stored if not _skipped(s, n, model)}
    targets = {p.target for p in quant.plan(names).values()}
    swapped = keep_quantized_modules(model, quant, targets, dense=False)
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert swapped == len(fp8) == 3 * config.n_routed_experts * (config.num_hidden_layers - 1)
    assert all(".mlp.experts." in n for n in fp8)

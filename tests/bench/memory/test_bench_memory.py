"""`swaserve bench memory` on tiny settings: files written, numbers equal to plan_pools'."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from transformers import MiMoV2FlashConfig

from bench.configs import CONFIG_DIR
from bench.memory import main as memory
from worker.kv.memory_plan import plan_pools
from worker.models.hf_config import load_spec

GIB = 1024**3


def _run(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--output-dir", str(out), *extra])
    return memory.run(args), out


@pytest.fixture(scope="module")
def tiny_mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("configs") / "mimo"
    MiMoV2FlashConfig(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, v_head_dim=16, sliding_window_size=32, vocab_size=128,
        moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, intermediate_size=32,
    ).save_pretrained(path)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def result(tiny_mimo: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    return _run(
        tmp, "--models", "gpt-oss-120b", str(tiny_mimo), "--budgets-gib", "0.002", "0.25",
        "--ratios", "0.25", "1.0", "--contexts", "256", "1024", "--page-size", "16",
    )  # fmt: skip


def test_writes_json_markdown_and_plots(result: tuple[int, Path]) -> None:
    """Exit 0; memory.json, summary.md and one PNG per model plus the two overview plots."""
    code, out = result
    assert code == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(
        ["admitted_gpt-oss-120b.png", "admitted_mimo.png", "token_gain_vs_ratio.png",
         "admitted_gain_vs_context.png"]
    )  # fmt: skip
    assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    md = (out / "summary.md").read_text()
    assert "### gpt-oss-120b, 0.25 GiB of KV" in md and "## mimo" in md
    assert "| one pool |" in md and "dual r=0.25" in md


def _charges(spec, context: int, page: int = 16, interval: int = 128) -> tuple[int, int]:
    full = -(-context // page) * page + page
    return full, min(spec.window + interval + page, full)


def test_numbers_match_plan_pools_and_the_admission_model(
    result: tuple[int, Path], tiny_mimo: Path
) -> None:
    """Every point's pool sizes equal plan_pools'; admitted follows the stated charges."""
    _, out = result
    data = json.loads((out / "memory.json").read_text())
    paths = {"gpt-oss-120b": CONFIG_DIR / "gpt-oss-120b.json", "mimo": tiny_mimo}
    checked = 0
    for model in data["models"]:
        spec = load_spec(paths[model["name"]])
        for b in model["budgets"]:
            budget = int(b["budget_gib"] * GIB)
            single = plan_pools(
                spec,
                page_size=16,
                dtype_bytes=2,
                kv_cache_bytes=budget,
                disable_hybrid_swa_memory=True,
            )
            assert b["single"]["full_tokens"] == single.full_tokens
            for c in (256, 1024):
                assert b["single"]["admitted"][str(c)] == single.full_tokens // _charges(spec, c)[0]
            for point in b["dual"]:
                if point["error"]:
                    assert "window + page_size" in point["error"]
                    continue
                plan = plan_pools(spec, page_size=16, dtype_bytes=2, kv_cache_bytes=budget,
                                  swa_full_tokens_ratio=point["ratio"])  # fmt: skip
                assert (point["full_tokens"], point["swa_tokens"]) == (
                    plan.full_tokens,
                    plan.swa_tokens,
                )
                for c in (256, 1024):
                    full, swa = _charges(spec, c)
                    want = min(plan.full_tokens // full, plan.swa_tokens // swa)
                    assert point["admitted"][str(c)] == want <= b["shared_admitted"][str(c)]
                checked += 1
    assert checked >= 5  # both models' 0.25 GiB points and the tiny MiMo's 2 MiB points


def test_a_budget_below_the_swa_floor_is_reported_not_fatal(result: tuple[int, Path]) -> None:
    """2 MiB for GPT-OSS-120B at r=0.25 cannot hold window + page: recorded as an error, 0 admitted."""
    _, out = result
    model = json.loads((out / "memory.json").read_text())["models"][0]
    tiny = model["budgets"][0]["dual"][0]
    assert tiny["ratio"] == 0.25 and tiny["error"] and set(tiny["admitted"].values()) == {0}


def test_equal_layer_sizes_make_ratio_one_equal_to_one_pool(result: tuple[int, Path]) -> None:
    """GPT-OSS (full and SWA layers alike): r = 1 plans exactly the single pool's tokens."""
    _, out = result
    model = json.loads((out / "memory.json").read_text())["models"][0]
    b = model["budgets"][1]
    r1 = next(p for p in b["dual"] if p["ratio"] == 1.0)
    assert r1["full_tokens"] == r1["swa_tokens"] == b["single"]["full_tokens"]


def test_vllm_comparison_appears_for_gpt_oss_120b_at_80_gib(tmp_path: Path) -> None:
    """With GPT-OSS-120B at 80 GiB the summary compares the default-ratio gain with vLLM's 1.77x."""
    code, out = _run(
        tmp_path, "--models", "gpt-oss-120b", "--budgets-gib", "80", "--ratios", "0.05", "0.8",
        "--contexts", "8192", "--no-plots",
    )  # fmt: skip
    md = (out / "summary.md").read_text()
    assert code == 0 and not list(out.glob("*.png"))
    assert "against vLLM's 1.77x" in md and "holds **1.11x** the tokens of one pool" in md


def test_unknown_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model that is neither shipped nor a local config: exit status 2 and the reason."""
    code, _ = _run(tmp_path, "--models", "no-such-model", "--no-plots")
    assert code == 2 and "never downloads" in capsys.readouterr().err

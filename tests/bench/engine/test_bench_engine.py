"""`swaserve bench engine` on tiny settings: files written, numbers sane and self-consistent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.engine import main as engine
from bench.engine.model import make_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 3


def _run(out: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    args = parser.parse_args(["--output-dir", str(out), *extra])
    return engine.run(args)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench") / "engine"
    code = _run(out, "--batch-sizes", "1", "2", "--prompt-len", "12", "--max-new-tokens",
                str(MAX_NEW), "--runs", "2", "--time-budget", "0", "--threads", "1")  # fmt: skip
    return code, out


def test_writes_json_markdown_and_plot(result: tuple[int, Path]) -> None:
    """Exit 0; engine.json, summary.md with one row per batch size, and a real PNG."""
    code, out = result
    assert code == 0
    assert (out / "engine_tokens_per_s.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "summary.md").read_text()
    assert "swaserve bench engine --batch-sizes 1 2 --prompt-len 12" in md
    rows = [
        line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2


def test_numbers_are_sane(result: tuple[int, Path]) -> None:
    """Positive timings, tokens/s = generated / best wall time, ratio consistent, batch 1 agrees."""
    _, out = result
    data = json.loads((out / "engine.json").read_text())
    assert data["hf_attn_implementation"] in ("eager", "sdpa")
    assert data["machine"]["cpus"] >= 1 and data["machine"]["torch_threads"] == 1
    assert [b["batch_size"] for b in data["batches"]] == [1, 2]
    for b in data["batches"]:
        assert b["generated_tokens"] == b["batch_size"] * MAX_NEW
        for side in ("ours", "transformers"):
            s = b[side]
            assert 0 < s["prefill_s"] and 0 < s["wall_s"] == min(s["all_wall_s"])
            assert len(s["all_wall_s"]) == 1  # --time-budget 0: no run after the first
            assert s["tokens_per_s"] == pytest.approx(b["generated_tokens"] / s["wall_s"])
        assert b["speedup"] == pytest.approx(
            b["ours"]["tokens_per_s"] / b["transformers"]["tokens_per_s"]
        )
        assert (
            0 < b["full_peak_used"] <= b["full_total"] and 0 < b["swa_peak_used"] <= b["swa_total"]
        )
        # The batch's prompts (<= 12 tokens) plus 3 new tokens, page-rounded, fit in 16 per request.
        assert b["full_peak_used"] <= 16 * b["batch_size"] + 16
    first = data["batches"][0]
    assert first["agree"] == 1 and first["first_mismatch"] is None


def test_scaled_model_has_the_requested_shape(tmp_path: Path) -> None:
    """--hidden/--layers build a wider, deeper random model of the same architecture."""
    from bench.engine.model import model_info, resolve_base, scaled_model

    base = model_info("tiny", resolve_base("tiny"))
    path = scaled_model(resolve_base("tiny"), 192, 8, tmp_path / "m")
    info = model_info("scaled", path)
    assert (info.model_type, info.hidden_size, info.num_layers) == (base.model_type, 192, 8)
    assert info.layer_types[:6] == base.layer_types and len(info.layer_types) == 8
    assert info.parameters > base.parameters


def test_prompts_are_deterministic_and_in_range() -> None:
    """Same seed, same prompts; lengths within [len/2, len]; ids skip the special tokens."""
    a, b = make_prompts(5, 20, 100), make_prompts(5, 20, 100)
    assert a == b
    assert all(10 <= len(p) <= 20 and min(p) >= 8 and max(p) < 100 for p in a)


def test_bad_flag_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--runs 0 is refused with the flag's name."""
    assert _run(tmp_path / "x", "--runs", "0") == 2
    assert "--runs must be >= 1" in capsys.readouterr().err

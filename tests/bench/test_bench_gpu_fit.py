"""Where GPT-OSS-120B and MiMo-V2-Flash fit, computed from the real configs: the parameter
counts match the published sizes, the fits the README states hold, and the README's table is
the one `bench.gpu_fit` computes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import gpu_fit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("model", "published"), [("gpt-oss-120b", 116.83e9), ("mimo-v2-flash", 309e9)])
def test_parameter_counts_match_the_published_sizes(model: str, published: float) -> None:
    assert gpu_fit.weights_of(model).params == pytest.approx(published, rel=0.005)


def test_gpt_oss_120b_bytes_bf16_and_mxfp4() -> None:
    """Nearly all of GPT-OSS-120B is experts: MXFP4 (4.25 bits) takes it from 234 GB to 65 GB as
    published, 68 GB as the fused SM90 kernel holds it (2880 padded to 2944)."""
    w = gpu_fit.weights_of("gpt-oss-120b")
    assert w.quantized / w.params > 0.98
    assert w.kernel_quantized == pytest.approx(w.quantized * (2944 / 2880) ** 2, rel=1e-9)
    published = dataclasses.replace(w, kernel_quantized=0)
    assert round(w.bytes(False) / 1e9) == 234 and round(published.bytes(True) / 1e9) == 65
    assert round(w.bytes(True) / 1e9) == 68


def test_mimo_bytes_fp8_attention_kept_on_one_gpu_only() -> None:
    """MiMo-V2-Flash's non-expert FP8 linears (~2%) are held FP8 by `keep` in one process and
    bf16 under tensor parallelism: 310 GB against 315 GB, 618 GB dequantized."""
    w = gpu_fit.weights_of("mimo-v2-flash")
    assert 0.01 < w.dense_quantized / w.params < 0.03 and w.quantized / w.params > 0.97
    assert [round(b / 1e9) for b in (w.bytes(False), w.bytes(True), w.bytes(True, 4))] == [618, 310, 315]


@pytest.mark.parametrize(
    ("model", "gpu", "n", "keep_quantized", "fits"),
    [
        ("gpt-oss-120b", "H200", 1, False, False),
        ("gpt-oss-120b", "H200", 2, False, True),
        ("gpt-oss-120b", "H100", 4, False, True),
        ("gpt-oss-120b", "H200", 1, True, True),
        ("gpt-oss-120b", "H100", 1, True, True),
        ("mimo-v2-flash", "H200", 4, False, False),
        ("mimo-v2-flash", "H200", 8, False, True),
        ("mimo-v2-flash", "H200", 2, True, False),
        ("mimo-v2-flash", "H200", 4, True, True),
    ],
)
def test_the_fits_the_readme_states(model: str, gpu: str, n: int, keep_quantized: bool, fits: bool) -> None:
    f = gpu_fit.fit(model, gpu, n, keep_quantized)
    assert f.fits is fits, f
    if fits:  # room for long contexts: at least 128k tokens of KV per GPU
        assert f.kv_tokens >= 128_000


def test_readme_shows_the_computed_table() -> None:
    assert gpu_fit.table() in (ROOT / "README.md").read_text()

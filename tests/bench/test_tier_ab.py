"""`swaserve bench tier-ab`: the request stream, the two sides' configs, the report, and (Ray) a
short served run where the tier turns revisits into loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import tier_ab
from bench.harness import write_json
from bench.machine import machine_info
from bench.tier_ab import HOST_KV_BYTES, Sample, SideResult, TierABResult, TierABSettings, config


def test_the_stream_revisits_every_head_with_a_fresh_tail() -> None:
    """Seeded: the same prompts twice; every head once per round, in order, its tail new."""
    s = TierABSettings(heads=3, head_tokens=40, rounds=2, tail_tokens=5)
    prompts = s.prompts()
    assert prompts == s.prompts() and [r for r, _ in prompts] == [0, 0, 0, 1, 1, 1]
    for i in range(3):
        (_, first), (_, again) = prompts[i], prompts[3 + i]
        assert first[:40] == again[:40] and (len(first), len(again)) == (45, 46)
        assert first[40:] != again[40:46]
    assert all(5 <= t < s.vocab for _, p in prompts for t in p)


def test_the_sides_differ_only_in_the_host_tier() -> None:
    """Both sides' configs are valid and equal but for `host_kv_bytes`."""
    s = TierABSettings()
    on, off = config(s, "on"), config(s, "off")
    assert (on.host_kv_bytes, off.host_kv_bytes) == (HOST_KV_BYTES, 0)
    assert on.model_dump() | {"host_kv_bytes": 0} == off.model_dump()
    assert on.max_total_tokens == 2048 and on.swa_full_tokens_ratio == 0.125 and on.workers == 2


def _side(side: str, cached: int, loaded: int, ttft_s: float) -> SideResult:
    samples = tuple(Sample(r, 300, cached * r, loaded * r, 0, "w0", ttft_s * (2 - r)) for r in (0, 1))
    return SideResult(side, 0, 10.0, samples)


def test_report_pools_the_repeats_of_each_side(tmp_path: Path) -> None:
    """Per side: prefill = prompt − cached, loaded tokens summed, TTFT over all requests and
    over revisits; the JSON is plain."""
    result = TierABResult(TierABSettings(), machine_info(),
                          (_side("off", 0, 0, 0.2), _side("on", 288, 288, 0.1)), 30.0, 1.0)  # fmt: skip
    off, on = tier_ab.side_rows(result)
    assert off[:7] == ["off", "2", "600", "600", "0.000", "0", "0"]
    assert on[:7] == ["on", "2", "600", "312", "0.480", "288", "0"]
    assert (on[9], off[9]) == ("100", "200")  # revisits: the round-1 requests
    assert "| on | 2 |" in tier_ab.summary(result)
    path = write_json(tmp_path / "r.json", result)
    assert json.loads(path.read_text())["sides"][1]["side"] == "on"


class _Metrics:
    """An ingress's `/metrics` whose counters grow by a step per read."""

    def __init__(self) -> None:
        self.reads = 0

    def get(self, path: str) -> object:
        assert path == "/metrics"
        self.reads += 1
        text = (
            "# HELP swaserve_loaded_prompt_tokens_total KV tokens loaded\n"
            f"swaserve_loaded_prompt_tokens_total {288.0 * self.reads}\n"
            "swaserve_loaded_prompt_tokens_created 1.7e9\n"
            f"swaserve_repaired_prompt_tokens_total {float(self.reads - 1)}\n"
        )
        return argparse.Namespace(status_code=200, text=text)


def test_served_counts_read_the_ingress_counters() -> None:
    """A stream's headers carry no loaded / repaired counts: they come from `/metrics`, whose
    `_total` samples are read (not `_created`), as integers."""
    http = _Metrics()
    assert tier_ab._served_counts(http) == (288, 0)
    assert tier_ab._served_counts(http) == (576, 1)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_served_ab_loads_revisited_prefixes_with_the_tier_only(tmp_path: Path) -> None:
    """8 heads x 2 rounds on 2 tiny workers: with the tier, revisits load from the host and
    compute less; without it nothing is loaded."""
    parser = argparse.ArgumentParser()
    tier_ab.add_arguments(parser)
    args = parser.parse_args(["--heads", "12", "--rounds", "2", "--output-dir", str(tmp_path)])
    assert tier_ab.run(args) == 0
    data = json.loads((tmp_path / "tier_ab.json").read_text())
    sides = {s["side"]: s["samples"] for s in data["sides"]}
    prefill = {k: sum(x["prompt_tokens"] - x["cached_tokens"] for x in v) for k, v in sides.items()}
    assert sum(x["loaded_tokens"] for x in sides["off"]) == 0
    assert sum(x["loaded_tokens"] for x in sides["on"]) > 0 and prefill["on"] < prefill["off"]
    assert (tmp_path / "summary.md").exists()

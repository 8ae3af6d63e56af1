"""Tensor parallelism on CPU: two ranks (gloo, two processes) compute what one rank computes, for
every architecture, and a rank that dies fails the engine instead of hanging it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.models.hf_tiny import ARCHS, make_tiny
from tests.worker.models.test_quantized import gpt_oss_mxfp4, mimo_fp8  # noqa: F401 - fixtures
from worker.assembly.rank_processes import ProcessRanks
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.errors import ConfigError

# SWA pool of 64 tokens: request A alone (40 + 24 tokens) only fits because decode frees the
# SWA KV that left the window (every window here is 8..16 keys).
POOLS = dict(page_size=4, max_total_tokens=512, swa_full_tokens_ratio=0.125,
             chunked_prefill_size=16, swa_eviction_interval=4)  # fmt: skip
ALL_SWA = {"mistral": dict(POOLS, max_total_tokens=64)}  # the cap applies to its one SWA pool


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_tiny")


def _run_checked(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int]]:
    """Generate with `check_integrity()` (every rank's pools included) after every step."""
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def sink(d: StreamDelta) -> None:
        got.setdefault(d.request_id, []).extend(d.token_ids)
        cached[d.request_id] = d.cached_tokens

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, on_delta=sink) for p in prompts]
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    return [(got[r], cached[r]) for r in rids]


def _scenario(engine: Engine) -> tuple[list[tuple[list[int], int]], int]:
    """Chunked prefill + SWA-pressured decode, then a prefix-cache hit batched with a cold one."""
    prompt = _tokens(40, seed=1)
    alone = _run_checked(engine, [prompt], max_tokens=24)
    swa_peak = engine.stats().swa.peak_used
    both = _run_checked(engine, [prompt[:32] + _tokens(6, seed=2), _tokens(20, seed=3)], 8)
    return alone + both, swa_peak


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_the_tokens_of_one(tiny_root: Path, arch: str) -> None:
    """TP = 2 gives TP = 1's greedy tokens through chunked prefill, SWA pressure and a cache hit."""
    path, pools = make_tiny(arch, tiny_root).path, ALL_SWA.get(arch, POOLS)
    one = Engine(EngineConfig(model=str(path), **pools))
    expected, _ = _scenario(one)
    two = Engine(EngineConfig(model=str(path), tensor_parallel_size=2, **pools))
    try:
        got, swa_peak = _scenario(two)
        assert two.allocator.swa_size == 64
        assert swa_peak < 40 + 24, "decode never freed out-of-window SWA KV"
        assert got[1][1] > 0, "the second prompt did not hit the cache"
        assert got == expected
        assert two.flush_cache()
        two.check_integrity()
    finally:
        two.close()


@pytest.mark.timeout(120)
def test_a_dead_rank_fails_the_engine_instead_of_hanging(tiny_root: Path) -> None:
    """SIGKILL rank 1: the engine reports it, and the next step raises (gloo) rather than hangs."""
    path = make_tiny("mimo_v2_flash", tiny_root).path
    engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=2, **POOLS))
    try:
        assert engine.rank_failure() is None
        tp = engine.parts.tp
        assert tp is not None and isinstance(tp.ranks, ProcessRanks)
        os.kill(tp.ranks.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.rank_failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waits on the engine noticing the dead rank
        assert "rank 1" in (engine.rank_failure() or "")
        engine.add_request(_tokens(8, seed=4), SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError):
            engine.step()
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_tensor_parallel_engine_keeps_the_configured_swa_eviction_policy(tiny_root: Path) -> None:
    """`swa_eviction_policy: lru` reaches rank 0's cache under tensor parallelism too."""
    path = make_tiny("mimo_v2_flash", tiny_root).path
    engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=2, swa_eviction_policy="lru", **POOLS))
    try:
        assert getattr(engine.cache, "tail_first", None) is False
    finally:
        engine.close()


def test_a_split_that_does_not_divide_is_refused_before_any_rank_starts() -> None:
    """Three ranks cannot share the tiny model's 4 query heads: ConfigError, no process left."""
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        Engine(EngineConfig(model="tiny", tensor_parallel_size=3))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "mimo_fp8"])
def test_two_ranks_keep_quantized_experts_and_give_the_tokens_of_one(name: str, request: pytest.FixtureRequest) -> None:
    """`quantized_weights: keep` under TP = 2: each rank holds its range of packed experts (MXFP4
    blocks and scales sliced by expert, whole FP8 expert linears) and the tokens are TP = 1's
    with the experts dequantized at load."""
    path = request.getfixturevalue(name).path
    prompts = [_tokens(9, seed=4), _tokens(30, seed=5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for tp, mode in ((1, "dequantize"), (2, "keep")):
        engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=tp, quantized_weights=mode, **POOLS))
        try:
            outs.append([o.token_ids for o in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert outs[0] == outs[1]

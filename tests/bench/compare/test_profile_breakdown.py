"""`bench.compare.profile_breakdown` on a hand-written py-spy raw profile."""

from __future__ import annotations

from bench.compare.profile_breakdown import (
    REPO_PREFIX,
    by_file,
    engine_part,
    parse_raw,
    worker_breakdown,
)

W = REPO_PREFIX
SITE = "/venv/lib/python3.11/site-packages/"
STD = "/usr/lib/python3.11/"
ROOT = f"Thread._bootstrap ({STD}threading.py:1002);AsyncEngine._loop ({W}worker/hosts/async_engine.py:120)"
STEP = f"{ROOT};Engine.step ({W}worker/engine/engine.py:200)"
RAW = "\n".join([
    f"thread (1): swaserve-engine;{STEP};ModelRunner.forward ({W}worker/runner/model_runner.py:90);"
    f"SelfAttention.forward ({W}worker/models/self_attention.py:50);Linear.forward ({SITE}torch/nn/modules/linear.py:125) 60",
    f"thread (1): swaserve-engine;{STEP};ModelRunner.forward ({W}worker/runner/model_runner.py:90);"
    f"PagedAttention.forward ({W}worker/models/layers.py:80);TorchBackend.run ({W}worker/attention/torch_backend.py:40) 20",
    f"thread (1): swaserve-engine;{STEP};RMSNorm.forward ({W}worker/models/layers.py:20) 5",
    f"thread (1): swaserve-engine;{STEP};Scheduler.schedule ({W}worker/scheduler/scheduler.py:10);"
    f"RadixCache.match ({W}worker/cache/radix_cache.py:5) 3",
    f"thread (1): swaserve-engine;{STEP} 2",
    f"thread (2);Worker.main_loop ({SITE}ray/_private/worker.py:900) 10",
    "thread (1): swaserve-engine 1",
    "not a stack line",
])  # fmt: skip


def test_parse_and_engine_parts() -> None:
    """Leaf-first parts: Linear inside attention is Linear; the backend is attention; the
    cache under the scheduler is the cache; the engine thread's share of all samples."""
    stacks = parse_raw(RAW)
    assert len(stacks) == 7 and stacks[5].thread == "" and stacks[0].thread == "swaserve-engine"
    w = worker_breakdown(stacks)
    assert (w.samples, w.engine_samples) == (101, 91)
    assert w.parts == {"linear": 60, "attention": 20, "norm": 5, "radix cache": 3, "engine other": 3}
    assert w.share("linear") == 60 / 101 and w.engine_share == 91 / 101
    assert engine_part([]) == "engine other"


def test_by_file_self_and_inclusive() -> None:
    stacks = parse_raw(RAW)
    self_time = by_file(stacks, inclusive=False)
    assert self_time["torch/nn/modules/linear.py"] == 60 and self_time["ray/_private/worker.py"] == 10
    incl = by_file(stacks, inclusive=True, prefix="worker/")
    assert incl["worker/engine/engine.py"] == 90 and incl["worker/models/layers.py"] == 25
    assert by_file(stacks, inclusive=True)["threading.py"] == 90

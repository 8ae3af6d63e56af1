"""`compile: auto|off` (docs/design.md §19): auto packs every dense linear on CPU and keeps greedy
tokens equal to transformers'; off leaves the model eager (the torch.compile path:
tests/worker/models/test_compiled.py)."""

from __future__ import annotations

import pytest
from torch import nn

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, tokens
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.models import packed as packing
from worker.models.packed import PackedLinear
from worker.runner.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _kinds(engine: Engine) -> tuple[int, int]:
    runner = engine.parts.runner
    assert isinstance(runner, ModelRunner)
    modules = list(runner.model.modules())
    return sum(type(m) is nn.Linear for m in modules), sum(
        isinstance(m, PackedLinear) for m in modules
    )


def _prompts() -> list[list[int]]:
    return [tokens(70, seed=61), tokens(5, seed=62)]


def test_auto_packs_linears_on_cpu(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on CPU (every size packed: the oracle's layers are all below the default floor): no
    nn.Linear left (routers are not nn.Linear), greedy tokens unchanged."""
    monkeypatch.setattr(packing, "PACK_MIN_ELEMENTS", 0)
    engine = oracle.engine(compile="auto")
    eager_linears, packed = _kinds(engine)
    assert eager_linears == 0 and packed > 0
    for p, out in zip(_prompts(), engine.generate(_prompts(), GREEDY)):
        assert out.token_ids == oracle.greedy(p, 8)


def test_off_leaves_the_model_eager(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """off: every linear is still an nn.Linear."""
    monkeypatch.setattr(packing, "PACK_MIN_ELEMENTS", 0)
    eager_linears, packed = _kinds(oracle.engine(compile="off"))
    assert eager_linears > 0 and packed == 0


def test_an_unknown_mode_is_refused() -> None:
    """A bad mode fails at engine build, naming the choices."""
    with pytest.raises(ValueError, match="auto.*off"):
        Engine(EngineConfig(compile="max"))


def _model(engine: Engine):  # noqa: ANN202 - the runner's CausalLM
    runner = engine.parts.runner
    assert isinstance(runner, ModelRunner)
    return runner.model


def test_auto_on_cpu_compiles_only_models_worth_it(oracle: Oracle) -> None:
    """CPU auto asks for inductor around the packed linears, for models of 20 M parameters or
    more; the tiny oracle (like every test model and the built-in one) is packed and eager."""
    import torch

    from worker.models import compiled

    plan = compiled.CompilePlan.for_mode("auto", torch.device("cpu"))
    assert plan.pack and plan.backend == "inductor"
    assert plan.min_parameters == compiled.CPU_COMPILE_MIN_PARAMETERS > 1_000_000
    assert _model(oracle.engine(compile="auto")).compiled is None


def test_a_failed_cpu_compile_serves_eagerly(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C++ compiler (or any inductor failure) at warm-up: the engine logs it and serves the
    packed model eagerly, with the same greedy tokens."""
    from worker.models import compiled

    monkeypatch.setattr(compiled, "CPU_COMPILE_MIN_PARAMETERS", 0)

    def broken(self: object, *args: object) -> None:
        raise RuntimeError("InductorError: no C++ compiler found")

    monkeypatch.setattr(compiled.CompiledForward, "forward", broken)
    engine = oracle.engine(compile="auto")
    model = _model(engine)
    assert model.compiled is None
    assert not any(getattr(m, "opaque", False) for m in model.modules())
    for p, out in zip(_prompts(), engine.generate(_prompts(), GREEDY)):
        assert out.token_ids == oracle.greedy(p, 8)

"""The torch.compile path of `compile: auto` (GPU; docs/design.md §19) run on CPU: dynamo traces
the decoder with each layer's pool write and attention as the opaque ``swaserve::paged_attention``
op, token counts dynamic, warmed up first; tokens and logits still match transformers.

The backend is aot_eager (dynamo + AOT tracing, no C++ build): what is under test is the graph
capture around the custom op, not inductor's kernels (those run in `swaserve bench compile`).
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.models.conftest import Archs, prompt_of
from tests.worker.models.driver import Driver
from tests.worker.models.test_parity import check_against_hf
from worker.models.compiled import CompilePlan, prepare_model
from worker.models.loader import load_model


@pytest.mark.parametrize("name", ["gemma3_text", "mimo_v2_flash", "gpt_oss"])
def test_compiled_decoder_matches_transformers(archs: Archs, name: str) -> None:
    """A dense model (Gemma 3: SWA + full layers, q/k norms) and both MoE ones: a long and a
    short prompt, prefill then decode. Warm-up compiles every variant the steps use: after it,
    with guard evaluation cut to the guards that tell variants apart, prefill, mixed and decode
    steps compile nothing more (a MoE block is one opaque op: no graph break, no per-layer
    recompile that `skip_guard_eval_unsafe` would turn into an error)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    arch = archs[name]
    model = load_model(arch.tiny.path, arch.spec)
    counter = CompileCounterWithBackend("aot_eager")
    done = prepare_model(
        model, CompilePlan(pack=False, backend=counter), torch.device("cpu"), torch.float32  # type: ignore[arg-type]
    )
    assert "torch.compile" in done and model.compiled is not None
    drv = Driver(arch.spec, model, page_size=4)
    drv.runner.warm_up()
    assert model.compiled.warmed
    compiled_at_warm_up = counter.frame_count
    assert compiled_at_warm_up == 4  # decoder and head, each for one token and for any count
    seqs = [drv.add(prompt_of(n, seed=70 + n), 12) for n in (3 * arch.window + 1, 2)]
    drv.run(seqs)
    assert counter.frame_count == compiled_at_warm_up
    for s in seqs:
        check_against_hf(arch, s)


def test_packed_linears_are_one_opaque_op_under_compile(archs: Archs, monkeypatch) -> None:
    """Packed (every size: the floor at 0) and compiled: each oneDNN product is the opaque
    ``swaserve::packed_linear`` op in the captured graph (inductor cannot lower the oneDNN
    weight); tokens and logits still match."""
    import worker.models.packed as packing

    monkeypatch.setattr(packing, "PACK_MIN_ELEMENTS", 0)
    targets: set[object] = set()

    def recording(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        targets.update(node.target for node in gm.graph.nodes)
        return gm.forward

    arch = archs["gemma3_text"]
    model = load_model(arch.tiny.path, arch.spec)
    plan = CompilePlan(pack=True, backend=recording)  # type: ignore[arg-type]
    done = prepare_model(model, plan, torch.device("cpu"), torch.float32)
    assert "linears packed" in done
    drv = Driver(arch.spec, model, page_size=4)
    drv.runner.warm_up()
    assert torch.ops.swaserve.packed_linear.default in targets or torch.ops.swaserve.packed_linear in targets, targets
    seqs = [drv.add(prompt_of(n, seed=80 + n), 12) for n in (3 * arch.window + 1, 2)]
    drv.run(seqs)
    for s in seqs:
        check_against_hf(arch, s)


def test_compiled_graph_copies_nothing_to_the_device(archs: Archs) -> None:
    """Gemma 3 (rope per kind, scaled embedding): the traced graphs create no tensor from
    Python values and move nothing between devices. On CUDA each such op was a blocking host
    copy per call, and illegal inside a CUDA-graph capture (the capture failed, graphs off)."""
    calls: list[tuple[str, list[object]]] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        for node in gm.graph.nodes:
            consts = [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, torch.fx.Node)]
            calls.append((str(node.target), consts))
        return gm.forward

    arch = archs["gemma3_text"]
    model = load_model(arch.tiny.path, arch.spec)
    prepare_model(model, CompilePlan(pack=False, backend=recording), torch.device("cpu"), torch.float32)  # type: ignore[arg-type]
    Driver(arch.spec, model, page_size=4).runner.warm_up()
    assert calls
    moved = [c for c in calls if any(isinstance(a, torch.device) for a in c[1])]
    made = [c for c in calls if "built-in method tensor" in c[0]]
    assert moved == [] and made == [], (moved, made)


def test_no_prompt_length_compiles_after_warm_up(archs: Archs) -> None:
    """Served prompts come in every length (a client's random 256-token prompts tokenize to
    256–258): after warm-up, prefills of many random lengths, one at a time and batched with
    others, compile nothing (a recompile in a request would cost its first token seconds)."""
    import random

    from torch._dynamo.testing import CompileCounterWithBackend

    arch = archs["gemma3_text"]
    model = load_model(arch.tiny.path, arch.spec)
    counter = CompileCounterWithBackend("aot_eager")
    prepare_model(model, CompilePlan(pack=False, backend=counter), torch.device("cpu"), torch.float32)  # type: ignore[arg-type]
    drv = Driver(arch.spec, model, page_size=4)
    drv.runner.warm_up()
    compiled_at_warm_up = counter.frame_count
    lengths = random.Random(0).sample(range(2, 3 * arch.window + 40), 12)
    for n in lengths[:4]:  # alone
        drv.run([drv.add(prompt_of(n, seed=n), 2)])
    drv.run([drv.add(prompt_of(n, seed=n), 3) for n in lengths[4:]])  # batched
    assert counter.frame_count == compiled_at_warm_up

"""`compile: auto`: the model prepared once at load — oneDNN-packed linears on CPU, and
`torch.compile` of the dense parts with attention as one opaque custom op (docs/design.md §19).

Piecewise scheme (vLLM's): dynamo traces the whole decoder, but the pool write and the attention
kernel of each layer are one opaque operator, ``swaserve::paged_attention`` (`opaque_ops`), that
inductor never looks into. The graph is therefore dense code (norms, projections, rope, MLPs,
the head) between opaque attention calls, compiled once with the token count dynamic.

NOTE: an operator takes tensors and scalars only, so the step's `ForwardContext` (pool, backend,
planned metadata, slots) cannot be an argument. `CompiledForward` puts it in a thread-local slot
for the duration of the compiled call and the op reads it there; eager forwards keep passing it
explicitly. The engine runs one step at a time per thread, so one slot per thread suffices.
"""

from __future__ import annotations

import itertools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.attention.base import AttentionLayer
from worker.config import COMPILE_MODES
from worker.errors import ConfigError
from worker.models.layers import PagedAttention
from worker.models.opaque_ops import define_opaque_op
from worker.models.packed import PackedLinear, pack_linears

if TYPE_CHECKING:
    from worker.models.causal_lm import CausalLM
    from worker.models.context import ForwardContext

logger = logging.getLogger(__name__)

# CPU `auto` packs the linears and, for a model of at least CPU_COMPILE_MIN_PARAMETERS, compiles
# the code between them with inductor (the packed products opaque; docs/design.md §19). Smaller
# models (the built-in tiny one, every test model) run packed and eager: inductor's C++ build
# (~25 s) would cost more than it saves. Measurement switches of `swaserve bench compile`:
# CPU_INDUCTOR (inductor + freezing of the unpacked model), CPU_PACK_ONLY (packing, no compile).
CPU_COMPILE_MIN_PARAMETERS = 20_000_000
CPU_INDUCTOR = False
CPU_PACK_ONLY = False


@dataclass(frozen=True)
class CompilePlan:
    """What preparing a model does: pack linears (CPU), compile with a backend (None: eager)."""

    pack: bool
    backend: str | None  # a torch.compile backend name ("inductor", "aot_eager") or None
    min_parameters: int = 0  # a smaller model is not compiled (CPU auto: CPU_COMPILE_MIN_PARAMETERS)

    @classmethod
    def for_mode(cls, mode: str, device: torch.device) -> CompilePlan:
        if mode not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        if mode == "off":
            return cls(pack=False, backend=None)
        if device.type == "cpu" and CPU_INDUCTOR:
            # NOTE: inductor cannot lower a model whose weights are already oneDNN tensors; its
            # freezing pass packs the (constant) weights itself.
            return cls(pack=False, backend="inductor")
        if device.type == "cpu":
            if CPU_PACK_ONLY:
                return cls(pack=True, backend=None)
            return cls(pack=True, backend="inductor", min_parameters=CPU_COMPILE_MIN_PARAMETERS)
        return cls(pack=False, backend="inductor")


# ---- the opaque attention op --------------------------------------------------------------------
_active = threading.local()  # .stack: list[tuple[ForwardContext, dict[int, AttentionLayer]]]


@contextmanager
def attention_context(ctx: ForwardContext, layers: dict[int, AttentionLayer]) -> Iterator[None]:
    stack = _active.__dict__.setdefault("stack", [])
    stack.append((ctx, layers))
    try:
        yield
    finally:
        stack.pop()


def _paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    sinks: torch.Tensor | None,  # [Hq]
    layer_id: int,
) -> torch.Tensor:
    """`PagedAttention.forward` of layer `layer_id` against the active step's context."""
    stack = getattr(_active, "stack", None)
    assert stack, "swaserve::paged_attention called outside attention_context (a compiled forward)"
    ctx, layers = stack[-1]
    ctx.pool.set_kv(layer_id, k, v, ctx.out_loc, ctx.swa_out_loc)
    out = ctx.backend.forward(layers[layer_id], q, ctx.attn_metadata, sinks).contiguous()
    # NOTE: the fake (below) promises a fresh contiguous tensor; a backend may return a strided
    # one, or (in principle) a view of q.
    same = out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    return out.clone() if same else out


def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, layer_id: int) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


define_opaque_op(
    "paged_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? sinks, int layer_id) -> Tensor",
    _paged_attention,
    _paged_attention_fake,
)


# ---- the compiled model ---------------------------------------------------------------------
class CompiledForward:
    """The decoder and the head under `torch.compile`, token count dynamic.

    Once `warmed` (after `ModelRunner.warm_up` compiled every variant: one token, which dynamo
    specialises, and any other count) each call runs with dynamo's guard evaluation cut to the
    guards that tell its compiled variants apart (`skip_guard_eval_unsafe`): the full guard set
    of this model (every parameter, module attribute and input property) cost ~0.28 ms per
    call on one CPU thread, two calls per step. That is safe because nothing a full guard checks
    changes after warm-up: the weights, modules and dtypes are fixed at load, and the runner's
    inputs are made the same way in warm-up and in steps (`tests/worker/models/test_compiled.py`
    asserts that serving compiles nothing after warm-up).
    """

    def __init__(self, model: CausalLM, backend: str) -> None:
        self.layers = {layer.layer_id: layer for layer in model.attention_layers()}
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.opaque = True
        decoder = model.model
        # CPU: freezing makes the weights constants, which lets inductor pack them (oneDNN/MKL).
        # NOTE: not on GPU, where constant folding would keep transposed copies of the weights.
        on_cpu = next(model.parameters()).device.type == "cpu"
        packed = any(isinstance(m, PackedLinear) for m in model.modules())
        options: dict[str, str | int | bool | Callable[..., object]] | None = (
            {"freezing": True} if backend == "inductor" and on_cpu and not packed else None
        )
        self._decoder = torch.compile(
            _own_code(lambda ids, pos: decoder(ids, pos, None)), backend=backend, options=options
        )
        self._logits: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
            _own_code(lambda hidden: model.logits_eager(hidden)), backend=backend, options=options
        )
        self.warmed = False

    def _guards(self) -> AbstractContextManager[None]:
        if not self.warmed:
            return nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        with attention_context(ctx, self.layers), self._guards():
            return self._decoder(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(hidden, 0)
        with self._guards():
            return self._logits(hidden)


_compiled_models = itertools.count()


def _own_code(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` with a code object of its own, under a name of its own.

    NOTE: dynamo keeps compiled variants per code object and its automatic-dynamic memory per
    code name: with one code object for every model of a process (several engines: tests,
    `bench compile`, `bench gpu-check`), a second model's variants sit beside the first's
    (`skip_guard_eval_unsafe` tells variants apart by their differing guards only), and
    attributes that differed between the models (a MoE block's registry index, a rope scale)
    became symbolic and recompiled. A renamed copy per `CompiledForward` keeps each model's own.
    """
    name = f"{fn.__name__}_model{next(_compiled_models)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def prepare_model(
    model: CausalLM, plan: CompilePlan, device: torch.device, dtype: torch.dtype,
    panel_copies: str = "off",
) -> str:  # fmt: skip
    """Apply `plan` to a loaded model, once (in place); the packed linears keep panel copies
    for small steps per `panel_copies` (`small_step_kernel`). Returns what was done, for the log."""
    done = []
    backend = plan.backend
    parameters = sum(p.numel() for p in model.parameters())  # before packing takes them out
    if backend is not None and parameters < plan.min_parameters:
        backend = None
        done.append(f"not compiled ({parameters / 1e6:.1f} M parameters, below {plan.min_parameters / 1e6:.0f} M)")
    if plan.pack:
        report = pack_linears(model, device, dtype, panel_copies=panel_copies)
        if report.skipped_reason is not None:
            done.append(f"unpacked ({report.skipped_reason})")
        else:
            done.append(f"{report.packed} linears packed")
            if report.panel_copy_bytes:
                done.append(f"panel copies for small steps ({report.panel_copy_bytes / 1e6:.1f} MB)")
    if backend is not None:
        model.compiled = CompiledForward(model, backend)
        done.append(f"torch.compile({backend}), attention opaque")
    return ", ".join(done) or "eager"


def uncompile(model: CausalLM) -> None:
    """Back to the eager forward (packed linears stay packed): when compiling fails."""
    model.compiled = None
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.opaque = False

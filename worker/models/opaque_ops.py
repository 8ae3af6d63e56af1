"""The engine's opaque torch operators (``swaserve::*``), defined on a plain `torch.library.Library`.

`torch.compile` must not look inside two things of a step: a oneDNN-packed product (inductor
cannot lower the packed weight) and the pool write + attention of a layer (it reads the step's
paged context). Each is an operator of the ``swaserve`` namespace with a fake (meta) kernel, so
dynamo traces it as one opaque call and inductor emits a call to it.

NOTE: they are defined with `Library.define` / `Library.impl`, not `torch.library.custom_op`:
the latter wraps every call in Python (dynamo disabled, a dispatch through `OpOverload`, and an
aliasing check of the outputs against the inputs), ~10 µs per call on one CPU thread against
~2.5 µs here; a decode step makes ~60 such calls (docs/design.md §19). The contract the aliasing check
enforced is the implementations' to keep: every output is a fresh tensor, never an input or a
view of one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("swaserve", "FRAGMENT")


def define_opaque_op(name: str, schema: str, impl: Callable[..., torch.Tensor],
                     fake: Callable[..., torch.Tensor]) -> None:  # fmt: skip
    """Define ``swaserve::<name>`` with `schema` (its arguments and returns, e.g.
    ``"(Tensor x, int i) -> Tensor"``: no alias annotations, so a functional op), `impl` on
    every device and `fake` for tracing."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"swaserve::{name}", fake, lib=_LIB)

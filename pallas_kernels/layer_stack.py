"""Every layer's weight for a layer kernel (the layer loop: jaxinfer/models/layer_loop.py).

Either a list, one weight per layer and each of its arrays an operand of its own (L
operands per array), or a ``Stacked`` weight: one weight of the same type whose every array
carries a leading layer axis [L, ...], one operand per array. The C++ kernels read layer l
of either by pointer (``ffi_lite.h`` ``RemainingArgs::layer``), so nothing is sliced or
copied. Why the stacked form: a loop carries every operand through XLA's while loop, and a
loaded XLA:CPU executable holds several KiB per HLO instruction; ~400 per-layer operands
cost ~4 MiB in each of the ~27 step executables, one stack per array almost nothing
(RESULTS.md, "Stacked layer weights").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax


@functools.partial(jax.tree_util.register_dataclass, data_fields=["value"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Stacked:
    """``value``: a weight (an array or a registered container) whose arrays are [L, ...]."""

    value: Any

    @property
    def layer(self) -> Any:
        """One layer's weight, abstract (ShapeDtypeStructs): for shape and type checks."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.value)


def members(ws: Sequence[Any] | Stacked) -> list[Any]:
    """The weights whose arrays are the operands: every layer's, or the one stack."""
    return [ws.value] if isinstance(ws, Stacked) else list(ws)


def layer_weights(ws: Sequence[Any] | Stacked) -> list[Any]:
    """One layer's weight each, for the checks every layer must pass: every layer's, or the
    stack's (abstract) one layer."""
    return [ws.layer] if isinstance(ws, Stacked) else list(ws)


def first_layer(ws: Sequence[Any] | Stacked) -> Any:
    """Layer 0's weight (abstract for a stack), for checks every layer shares; None if none."""
    if isinstance(ws, Stacked):
        return ws.layer
    return next(iter(ws), None)

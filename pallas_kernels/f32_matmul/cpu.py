"""The CPU float32 matmul: a C++ kernel (f32_matmul.cc) called through jax.ffi.

XLA:CPU picks its dot kernel by the number of rows and each sums over K in its own order,
so the batch-invariant engine had to run every dot in fixed 32-row tiles (slow at batch 1).
This kernel computes every output as one k-ordered FMA chain whatever M, tile or thread,
so it is bitwise batch-invariant by construction (see the .cc header) and serves both the
plain and the batch-invariant engine: jaxinfer/matmul.py routes float32 weights
here on the CPU backend. Weights are read in their stored [K, N] layout, or in the
panel-major layout of ``panel`` (a ``PanelledF32``), which the kernel reads without
copying: the engine lays a single-device model's weights out so at load time
(quantization.prepare_float_for_cpu). Both layouts give the same bits.

Built on first use by pallas_kernels/cpu_build.py; without a compiler ``available()`` is
False with the reason in ``unavailable_reason()`` and the engine keeps XLA's dots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.layer_stack import Stacked, first_layer, layer_weights, members

TARGET = "jaxinfer_f32_matmul"
TARGET_PANELS = "jaxinfer_f32_matmul_panels"
TARGET_LAYER = "jaxinfer_f32_matmul_layer"
TARGET_CODES = "jaxinfer_f32_matmul_codes"
TARGET_DEQUANT = "jaxinfer_codes_dequant"
TARGET_CODES_ROWS = "jaxinfer_codes_rows"
TARGET_ENCODE = "jaxinfer_codes_encode"
_KERNEL = cpu_build.Kernel("f32_matmul/f32_matmul.cc", {TARGET: "JaxinferF32Matmul",
                                             TARGET_PANELS: "JaxinferF32MatmulPanels",
                                             TARGET_LAYER: "JaxinferF32MatmulLayer",
                                             TARGET_CODES: "JaxinferF32MatmulCodes",
                                             TARGET_DEQUANT: "JaxinferCodesDequant",
                                             TARGET_CODES_ROWS: "JaxinferCodesRows",
                                             TARGET_ENCODE: "JaxinferCodesEncode"}, "f32 matmul")
PANEL = 16   # columns per panel: the GEMM's register tile width
CODE_BLOCK = 32   # rows of K per scale / offset in a CodedF32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PanelledF32:
    """A float32 [K, N] weight stored panel-major: ``panels`` f32 [N/16, K, 16], panel j
    holding columns [16j, 16j + 16). Why: the GEMM's register tiles read a 16-column
    panel down K; from the stored [K, N] layout each call first copied every panel into a
    contiguous buffer (the row stride maps a panel onto a few cache sets), and at decode
    batch sizes that copy, straight from memory, was a third of the matmul time. Here each
    panel is already one sequential stream. Made once at load time by ``panel``."""

    panels: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        n_panels, k, p = self.panels.shape
        return (k, n_panels * p)

    @property
    def dtype(self) -> Any:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.size * self.panels.dtype.itemsize

    def unpanelled(self) -> jax.Array:
        """The weight in the plain [K, N] layout."""
        K, N = self.shape
        return self.panels.transpose(1, 0, 2).reshape(K, N)

    def columns_as_rows(self, cols: jax.Array) -> jax.Array:
        """cols i32[T] -> [T, K]: columns of the weight (a tied LM head's embedding rows)."""
        return self.panels[cols // PANEL, :, cols % PANEL]

    def __getitem__(self, key: Any) -> "PanelledF32":
        """``param[...]`` (how a model reads its weights) returns the weight itself."""
        if key is Ellipsis:
            return self
        raise TypeError("PanelledF32 supports only [...] indexing")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale", "offset"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CodedF32:
    """A float32 [K, N] weight whose values are exactly ``scale * code + offset`` (the
    product rounded, then the sum) per block of 32 rows of a column, stored as those codes:
    ``codes`` int8 [N/16, K, 16] (panel-major as PanelledF32), ``scale`` / ``offset`` f32
    [N/16, K/32, 16]. A GGUF's Q4_1 / Q8_0 weights dequantized to float32 are such values
    (pallas_kernels/f32_matmul/codes.py finds them and checks every one). The kernel turns
    each panel back into those floats before its FMA chains, so every product is bitwise the
    float32 weight's; 1.25 bytes a weight instead of 4. Why: the default model's float32
    weights were 513 of the engine's ~1,400 MiB resident (issue 16)."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        n_panels, k, p = self.codes.shape
        return (k, n_panels * p)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(jnp.float32)      # what it computes as: the float32 weight

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.codes, self.scale, self.offset))

    def panelled(self) -> PanelledF32:
        """The float32 weight itself, panel-major (the kernel's own dequantization)."""
        out = jax.ShapeDtypeStruct(self.codes.shape, jnp.float32)
        return PanelledF32(jax.ffi.ffi_call(TARGET_DEQUANT, out)(self.codes, self.scale, self.offset))

    def unpanelled(self) -> jax.Array:
        """The float32 weight in the plain [K, N] layout."""
        return self.panelled().unpanelled()

    def columns_as_rows(self, cols: jax.Array) -> jax.Array:
        """cols i32[T] -> f32 [T, K]: columns of the weight (a tied LM head's embedding rows)."""
        out = jax.ShapeDtypeStruct((cols.shape[0], self.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(TARGET_CODES_ROWS, out)(cols.astype(jnp.int32), self.codes, self.scale,
                                                        self.offset)

    def __getitem__(self, key: Any) -> "CodedF32":
        """``param[...]`` (how a model reads its weights) returns the weight itself."""
        if key is Ellipsis:
            return self
        raise TypeError("CodedF32 supports only [...] indexing")


def panel(w: jax.Array) -> PanelledF32 | jax.Array:
    """A float32 [K, N] weight in the panel-major layout (``PanelledF32``); a weight whose N
    is not a multiple of 16 stays as it is (the kernel's plain path serves it)."""
    if w.ndim != 2 or w.dtype != jnp.float32:
        raise ValueError(f"panel: expected a float32 [K, N] weight, got {w.dtype} {w.shape}")
    K, N = w.shape
    if N % PANEL:
        return w
    return PanelledF32(jnp.asarray(w).reshape(K, N // PANEL, PANEL).transpose(1, 0, 2))


# built, loaded and registered with XLA:CPU once, on the first available()
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


@functools.partial(jax.jit, inline=True)
def f32_matmul(x: jax.Array, w: jax.Array | PanelledF32 | CodedF32) -> jax.Array:
    """x f32 [M, K] @ w f32 [K, N] (plain, a ``PanelledF32`` or a ``CodedF32``) -> f32 [M, N],
    each output one k-ordered FMA chain, the same bits for every layout. Call ``available()``
    first: it registers the kernel."""
    panelled = isinstance(w, (PanelledF32, CodedF32))
    if x.ndim != 2 or (not panelled and w.ndim != 2):
        raise ValueError(f"f32_matmul: expected x [M, K] and w [K, N], got x {x.shape}, w {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"f32_matmul: x and w must be float32, got x {x.dtype}, w {w.dtype}")
    K, N = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}] (K = w.shape[0]), got shape {x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32)
    if isinstance(w, CodedF32):
        return jax.ffi.ffi_call(TARGET_CODES, out)(x, w.codes, w.scale, w.offset)
    if panelled:
        return jax.ffi.ffi_call(TARGET_PANELS, out)(x, w.panels)
    return jax.ffi.ffi_call(TARGET, out)(x, w)


def _layout(w: Any) -> type | None:
    """A weight's layout: PanelledF32, CodedF32 or None (a plain [K, N] array)."""
    return type(w) if isinstance(w, (PanelledF32, CodedF32)) else None


def f32_matmul_layer(x: jax.Array, ws: Sequence[jax.Array | PanelledF32 | CodedF32] | Stacked,
                     layer: jax.Array) -> jax.Array:
    """x f32 [M, K] @ ws[layer] -> f32 [M, N], the same bits as ``f32_matmul(x, ws[layer])``.
    ``ws``: every layer's weight, all of one shape and layout, each an operand of its own or
    all in one ``Stacked`` weight (pallas_kernels/layer_stack.py); ``layer``: a traced i32
    scalar (e.g. a ``lax.fori_loop`` index). The kernel picks the layer's by pointer, so
    inside a loop nothing is sliced or copied (XLA's dynamic slice of a stack would be a copy
    per iteration; benchmarks/layer_loop_probe.py). Call ``available()`` first."""
    items, w0 = members(ws), first_layer(ws)
    if not items:
        raise ValueError("f32_matmul_layer: needs at least one weight")
    kind = type(items[0])
    layers = layer_weights(ws)
    if any(_layout(w) is not _layout(w0) or w.shape != w0.shape or w.dtype != jnp.float32 for w in layers):
        raise ValueError("f32_matmul_layer: every weight must be float32 of one shape and layout, got "
                         f"{sorted({(tuple(w.shape), str(w.dtype), type(w).__name__) for w in layers})}")
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] != w0.shape[0]:
        raise ValueError(f"f32_matmul_layer: x must be float32 [M, K={w0.shape[0]}], got {x.dtype} {x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w0.shape[1]), jnp.float32)
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    if kind is CodedF32:
        return jax.ffi.ffi_call(TARGET_LAYER, out)(
            x, idx, *[w.codes for w in items], *[w.scale for w in items], *[w.offset for w in items])
    return jax.ffi.ffi_call(TARGET_LAYER, out)(x, idx, *[w.panels if kind is PanelledF32 else w for w in items])


def f32_matmul_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The kernel's math in numpy float64 (what its f32 FMA chain approximates)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)

"""Weight-only quantization at load time: ``--quantization int8 | int4``.

Every matmul weight of the model (q/k/v/o, gate/up/down, the LM head) becomes a
``QuantizedWeight`` (pallas_kernels/quantized_matmul/): int8 with one scale per output
channel, or int4 packed two per byte with one scale per group of rows along K. The
embedding table stays in the model dtype (it is gathered, not multiplied). The model's
``mm`` hook takes either kind of weight: on TPU / GPU the Pallas kernel; on CPU int8 goes
to the C++ kernel (pallas_kernels/quantized_matmul/cpu.py; weights packed in its panels
here) and int4 to XLA (dequantize, then the dot; see jaxinfer/matmul.py).

Why our own ~40 lines and not qwix / aqt: the kernels read one specific packed layout
(K-packed nibbles, f32 scales per group), and our matmuls are one explicit hook rather
than einsum/dot calls a library could intercept in module code; the quantizer is a max-abs
scale and a round. qwix's PTQ rewrites module calls and would still need a converter to
this layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

MODES = {"int8": 8, "int4": 4}
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def int4_group(cfg: Any) -> int:
    """The largest group in (128, 64, 32) that divides every matmul's K (the hidden size,
    the attention width and the MLP width): SmolLM2's 576 takes 64."""
    ks = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    for g in (128, 64, 32):
        if all(k % g == 0 for k in ks):
            return g
    raise ValueError(f"quantization int4: no group of 128, 64 or 32 rows divides the model's "
                     f"matmul widths {ks}")


def check_mode(mode: str | None) -> int | None:
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(f"quantization: unsupported {mode!r}; choose one of {', '.join(MODES)} "
                         "(or none)")
    return MODES[mode]


def quantize_model(model: nnx.Module, mode: str | None) -> nnx.Module:
    """A new module whose matmul weights are quantized (the given one is left as it is)."""
    bits = check_mode(mode)
    if bits is None:
        return model
    if not getattr(type(model), "quantization", True):
        raise ValueError(f"quantization: {mode} weights are not supported for {model.cfg.architecture} "
                         "(mixture-of-experts weights are not quantized yet); run it unquantized")
    from jaxinfer.matmul import pack_for_backend
    from pallas_kernels.quantized_matmul.xla import quantize

    group = int4_group(model.cfg) if bits == 4 else 0
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        if path[-1] in MATMUL_WEIGHTS:
            w = quantize(var.get_value(), bits, group or 128)
            var = var.replace(value=pack_for_backend(w))
        flat.append((path, var))
    return fuse_projections(nnx.merge(graphdef, nnx.from_flat_state(flat)))


# Matmuls that read the same input, fused into one weight: (fused name, parts in order).
FUSED = (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up")))


def fuse_projections(model: nnx.Module) -> nnx.Module:
    """In place: each layer's q/k/v and gate/up weights become one weight each (``wqkv``,
    ``w_gate_up``; the model splits the product) where all parts are in the CPU kernel's
    panel layout. Why: a decode step is ~7 small kernel calls per layer, each paying a
    fixed ~10-15 us (FFI call, thread hand-off); fused it is 4. Exact: the packed kernel
    computes every output column from its own panel and the row's activations alone, so the
    fused product is bitwise the concatenation of the separate ones (tested)."""
    from pallas_kernels.quantized_matmul.xla import QuantizedWeight

    for layer in model.layers:
        for fused, parts in FUSED:
            if not all(hasattr(layer, p) for p in parts):    # e.g. a plain (ungated) MLP
                continue
            ws = [getattr(layer, p)[...] for p in parts]
            if all(getattr(w, "panel", 0) for w in ws):
                q = jnp.concatenate([w.q for w in ws], axis=0)              # panels: [N/32, K/2, 32, 2]
                scales = jnp.concatenate([w.scales for w in ws], axis=0)    # [N]
                value = QuantizedWeight(q, scales, 8, 0, ws[0].panel)
            elif all(_f32_kernel_weight(w) for w in ws):
                value = jnp.concatenate(ws, axis=1)                         # [K, N_q + N_k + N_v]
            else:
                continue
            setattr(layer, fused, nnx.Param(value))
            for p in parts:
                delattr(layer, p)
    return model


def _f32_kernel_weight(w) -> bool:
    from jaxinfer.matmul import f32_kernel_applies

    return not hasattr(w, "scales") and f32_kernel_applies(w)


def prepare_float_for_cpu(model: nnx.Module) -> nnx.Module:
    """A new module (the given one untouched) laid out for the CPU f32 kernel
    (pallas_kernels/f32_matmul/cpu.py); the module itself where the kernel does not apply.

    * q/k/v and gate/up weights are fused into one weight each: every output column is its
      own k-ordered FMA chain, so the fused product is bitwise the separate ones, and a
      decode step makes 4 kernel calls a layer instead of 7;
    * every matmul weight is stored panel-major (``cpu_f32_matmul.panel``), which the kernel
      reads without the per-call copy: the same bits, 15-40% faster at decode batch sizes.

    Single-device models only (a fused or panelled weight would shard differently)."""
    from jaxinfer.matmul import f32_kernel_applies
    from pallas_kernels.f32_matmul.cpu import panel

    w = model.layers[0].wq[...]
    if not f32_kernel_applies(w) or len(getattr(w, "devices", lambda: [None])()) != 1:
        return model
    graphdef, state = nnx.split(model)
    model = fuse_projections(nnx.merge(graphdef, state))
    names = set(MATMUL_WEIGHTS) | {fused for fused, _ in FUSED}
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if path[-1] in names and isinstance(value, jax.Array) and value.dtype == jnp.float32:
            var = var.replace(value=panel(value))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def is_quantized(model: nnx.Module) -> bool:
    # (the LM head is never fused, so it tells for every layout)
    return hasattr(model.lm_head.get_value(), "scales")


def cpu_compiler_options(model: nnx.Module) -> dict | None:
    """Compile options a jitted step over ``model`` needs on this backend: XLA:CPU's
    quantized path (int4; int8 without the C++ kernel) needs the memory-optimized
    scheduler (pallas_kernels/quantized_matmul/); float and kernel-served int8 models
    keep XLA's default scheduling."""
    import jax

    if not is_quantized(model) or jax.default_backend() != "cpu":
        return None
    from pallas_kernels.quantized_matmul import cpu as cpu_matmul
    from pallas_kernels.quantized_matmul.xla import XLA_CPU_COMPILER_OPTIONS, QuantizedWeight

    ws = [x for x in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QuantizedWeight))
          if isinstance(x, QuantizedWeight)]
    if all(w.bits == 8 for w in ws) and cpu_matmul.available():
        return None
    return dict(XLA_CPU_COMPILER_OPTIONS)


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of every parameter array (quantized values and scales included)."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))

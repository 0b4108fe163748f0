"""Weight-only quantization at load time: ``--quantization int8 | int4``.

Every matmul weight of the model (q/k/v/o, gate/up/down, the LM head) becomes a
``QuantizedWeight`` (pallas_kernels/quantized_matmul/): int8 with one scale per output
channel, or int4 packed two per byte with one scale per group of rows along K. The
embedding table stays in the model dtype (it is gathered, not multiplied). The model's
``mm`` hook takes either kind of weight: on TPU / GPU the Pallas kernel; on CPU both go
to the C++ kernel (pallas_kernels/quantized_matmul/cpu.py; weights packed in its panels
here; int4 there is affine per 32 rows with the LM head int8: ``_weight_quantizer``), or,
without that kernel, to XLA (dequantize, then the dot; see jaxinfer/matmul.py).

Why our own ~40 lines and not qwix / aqt: the kernels read one specific packed layout
(K-packed nibbles, f32 scales per group), and our matmuls are one explicit hook rather
than einsum/dot calls a library could intercept in module code; the quantizer is a max-abs
scale and a round. qwix's PTQ rewrites module calls and would still need a converter to
this layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
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


def quantize_model(model: nnx.Module, mode: str | None, in_place: bool = False) -> nnx.Module:
    """A module whose matmul weights are quantized: a new one sharing the given one's other
    weights, or (``in_place``) the given one, each float weight freed as soon as its
    quantized form exists (a load then never holds two copies of the weights). int4 where
    the CPU kernel runs: see ``_weight_quantizer`` and ``head_bits``."""
    bits = check_mode(mode)
    if bits is None:
        return model
    if not getattr(type(model), "quantization", True):
        raise ValueError(f"quantization: {mode} weights are not supported for {model.cfg.architecture} "
                         "(mixture-of-experts weights are not quantized yet); run it unquantized")
    quantized = _weight_quantizer(model.cfg, bits)
    head = _weight_quantizer(model.cfg, head_bits(bits))
    model = model if in_place else _shallow_copy(model)
    heads = {id(v) for v in _matmul_params(model, ("lm_head",))}
    for param in _matmul_params(model, MATMUL_WEIGHTS):
        if not hasattr(param.get_value(), "scales"):      # weight_finisher may have done it
            param.set_value((head if id(param) in heads else quantized)(param.get_value()))
    return fuse_projections(model)


def head_bits(bits: int) -> int:
    """The LM head's bits for a model quantized to ``bits``: int8 for int4 where the CPU
    kernel's 4-bit panels run (4 bits lose most of a Q8_0 / Q6_K table's precision for
    ~a fifth of the bytes: a 'self' draft's acceptance fell 94% -> 79% with a 4-bit head,
    RESULTS.md "A 4-bit draft"; llama.cpp's Q4 formats keep the output tensor wider too),
    else ``bits``."""
    from jaxinfer.matmul import int4_kernel_available

    return 8 if bits == 4 and int4_kernel_available() else bits


def _weight_quantizer(cfg: Any, bits: int) -> Callable[[jax.Array], Any]:
    """One float matmul weight -> its quantized form, laid out for this backend's kernel
    (the one rule quantize_model and weight_finisher share). int4 on CPU: weights the C++
    kernel's 4-bit panels fit take that form (affine per 32 rows, the GGUF Q4_1 scheme, so
    a Q4_1 checkpoint's codes come back exactly; pallas_kernels/quantized_matmul/cpu.py
    quantize_int4); elsewhere, and for weights they do not fit, the symmetric int4 per group
    (accelerators' kernels; on CPU XLA's convert-then-dot, ~10x slower)."""
    from jaxinfer.matmul import int4_kernel_applies, pack_for_backend

    group = (int4_group(cfg) if bits == 4 else 0) or 128

    def quantized(w: jax.Array) -> Any:
        if bits == 4 and int4_kernel_applies(w):
            from pallas_kernels.quantized_matmul import cpu as cpu_matmul
            return cpu_matmul.quantize_int4(w)
        return pack_for_backend(_quantize(w, bits, group))
    return quantized


def weight_finisher(cfg: Any, mode: str | None, codes: bool = True) -> Callable[[str, jax.Array], Any] | None:
    """For a load (loading.load_model's ``finish``): each matmul weight quantized as it is
    read, exactly as quantize_model would (per weight, fused afterwards), and the embedding
    coded as code_embedding would (``codes``), so a quantized load never holds the whole
    float32 model (the int8 default model's cold load peaked at ~960 MiB that way). A
    float load on CPU: ``_float_finisher`` (panelled and coded as read). None off CPU
    when nothing is quantized, or where the family is not quantized (MoE)."""
    from jaxinfer.models.registry import model_class

    bits = check_mode(mode)
    if bits is None:
        return _float_finisher(codes) if jax.default_backend() == "cpu" else None
    if not getattr(model_class(cfg.architecture), "quantization", True):
        return None
    hb = head_bits(bits)
    quantized, head = _weight_quantizer(cfg, bits), _weight_quantizer(cfg, hb)
    shared: dict[str, Any] = {}       # a tied int8 head: the one int8 table (share_tied_table)

    def finish(path: str, value: jax.Array) -> Any:
        if cfg.tie_word_embeddings and hb == 8 and path in ("embed", "lm_head"):
            # both are read from the same checkpoint tensor: quantized once, as the head
            if "head" not in shared:
                shared["head"] = _head_from_table(value, head) if path == "embed" else head(value)
            return TiedEmbedding(shared["head"]) if path == "embed" else shared["head"]
        if path == "embed" and codes:
            return coded_table(value)
        name = path.rsplit(".", 1)[-1]
        if name not in MATMUL_WEIGHTS:
            return value
        return (head if name == "lm_head" else quantized)(value)

    return finish


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w: jax.Array, bits: int, group: int) -> Any:
    """pallas_kernels.quantized_matmul.xla.quantize as one compiled function: its eager ops
    would each hold a full-size float temporary (three at once for the 113 MB LM head)."""
    from pallas_kernels.quantized_matmul.xla import quantize

    return quantize(w, bits, group)


def _shallow_copy(model: nnx.Module) -> nnx.Module:
    """A new module (new Variables) holding the same arrays: changing its weights leaves
    ``model`` as it was."""
    graphdef, state = nnx.split(model)
    flat = [(path, var.replace(value=var.get_value())) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _float_finisher(codes: bool) -> Callable[[str, jax.Array], Any]:
    """For a float32 load on CPU: each 2-D matmul weight panelled for the f32 kernel and
    coded (``codes``) as it is read, as prepare_float_for_cpu would do it after the load
    (it then fuses the panelled parts: ``_join_panelled``), so the load never holds the
    whole float32 model (the default model's cold float32 load peaked at the float model
    plus its transients)."""
    from jaxinfer.matmul import f32_kernel_applies
    from pallas_kernels.f32_matmul.codes import encode
    from pallas_kernels.f32_matmul.cpu import PanelledF32

    def finish(path: str, value: jax.Array) -> Any:
        if path.rsplit(".", 1)[-1] not in MATMUL_WEIGHTS or value.ndim != 2 or not f32_kernel_applies(value):
            return value
        value = _panel(value)
        if codes and isinstance(value, PanelledF32):
            value = encode(value) or value
        return value

    return finish


def _join_panelled(ws: Sequence[Any]) -> Any:
    """Panel-major parts (PanelledF32 / CodedF32, each a multiple of 16 columns) fused along
    the panel axis: the fused weight panelled, since a panel holds its own 16 columns (and
    its codes depend on those alone); coded where every part is."""
    from pallas_kernels.f32_matmul.cpu import CodedF32, PanelledF32

    if all(isinstance(w, CodedF32) for w in ws):
        return CodedF32(*(jnp.concatenate([getattr(w, f) for w in ws]) for f in ("codes", "scale", "offset")))
    return PanelledF32(jnp.concatenate([w.panelled().panels if isinstance(w, CodedF32) else w.panels
                                        for w in ws]))


def _matmul_params(model: nnx.Module, names: Any) -> list[nnx.Variable]:
    """The model's own Variables (not copies: setting one changes the model) whose
    attribute name is in ``names``, wherever they sit in the module tree."""
    return [v for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable) and path[-1] in names]


# Matmuls that read the same input, fused into one weight: (fused name, parts in order).
FUSED = (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up")))


def fuse_projections(model: nnx.Module, layout: Any = None) -> nnx.Module:
    """In place: each layer's q/k/v and gate/up weights become one weight each (``wqkv``,
    ``w_gate_up``; the model splits the product) where all parts are in the CPU kernel's
    panel layout; ``layout`` (float32 parts): applied to the fused weight in the same
    compiled function (one copy made, not two). Why: a decode step is ~7 small kernel calls per layer, each paying a
    fixed ~10-15 us (FFI call, thread hand-off); fused it is 4. Exact: the packed kernel
    computes every output column from its own panel and the row's activations alone, so the
    fused product is bitwise the concatenation of the separate ones (tested)."""
    from pallas_kernels.f32_matmul.cpu import CodedF32, PanelledF32
    from pallas_kernels.quantized_matmul.xla import QuantizedWeight

    panelled = (PanelledF32, CodedF32)
    for layer in model.layers:
        for fused, parts in FUSED:
            if not all(hasattr(layer, p) for p in parts):    # e.g. a plain (ungated) MLP
                continue
            ws = [getattr(layer, p)[...] for p in parts]
            if all(getattr(w, "panel", 0) for w in ws) and len({w.bits for w in ws}) == 1:
                # every array's leading axis is the column panels (int8 scales: [N])
                cat = lambda name: jnp.concatenate([getattr(w, name) for w in ws], axis=0)
                value = dataclasses.replace(ws[0], q=cat("q"), scales=cat("scales"),
                                            offsets=cat("offsets") if ws[0].offsets is not None else None)
            elif all(isinstance(w, panelled) for w in ws):                 # a float32 load's (_float_finisher)
                value = _join_panelled(ws)
            elif all(_f32_kernel_weight(w) for w in ws):
                ws = [w.unpanelled() if isinstance(w, panelled) else w for w in ws]
                value = _concatenate(tuple(ws), layout)                     # [K, N_q + N_k + N_v]
            else:
                continue
            setattr(layer, fused, nnx.Param(value))
            for p in parts:
                delattr(layer, p)
    return model


@functools.partial(jax.jit, static_argnums=1)
def _concatenate(ws: tuple[jax.Array, ...], layout: Any) -> Any:
    fused = jnp.concatenate(ws, axis=1)
    return fused if layout is None else layout(fused)


def _f32_kernel_weight(w) -> bool:
    from jaxinfer.matmul import f32_kernel_applies

    return not hasattr(w, "scales") and f32_kernel_applies(w)


def prepare_float_for_cpu(model: nnx.Module, in_place: bool = False, codes: bool = True) -> nnx.Module:
    """The module laid out for the CPU f32 kernel (pallas_kernels/f32_matmul/cpu.py): a new
    one (the given one untouched) or, ``in_place``, the given one, each weight replaced as
    it is converted (no second copy of the model at any time); the module itself where the
    kernel does not apply.

    * q/k/v and gate/up weights are fused into one weight each: every output column is its
      own k-ordered FMA chain, so the fused product is bitwise the separate ones, and a
      decode step makes 4 kernel calls a layer instead of 7;
    * every matmul weight is stored panel-major (``cpu_f32_matmul.panel``), which the kernel
      reads without the per-call copy: the same bits, 15-40% faster at decode batch sizes;
    * a weight whose floats are exactly a block-quantized checkpoint's (a GGUF's Q4_1 /
      Q8_0, dequantized by the loader) is kept as those codes (``CodedF32``): the kernel
      computes with the very same floats, at 1.25 bytes a weight instead of 4 (``codes``).

    Single-device models only (a fused or panelled weight would shard differently)."""
    from jaxinfer.matmul import f32_kernel_applies
    from pallas_kernels.f32_matmul.cpu import panel

    w = model.layers[0].wq[...]
    if not f32_kernel_applies(w) or len(getattr(w, "devices", lambda: [None])()) != 1:
        return model
    model = fuse_projections(model if in_place else _shallow_copy(model), panel)
    for param in _matmul_params(model, MATMUL_WEIGHTS):
        value = param.get_value()
        if isinstance(value, jax.Array) and value.dtype == jnp.float32:
            param.set_value(_panel(value))
    model = tie_embedding(model)
    return code_weights(model) if codes else model


def code_weights(model: nnx.Module) -> nnx.Module:
    """In place: every panel-major float32 matmul weight whose floats have exact block codes
    (pallas_kernels/f32_matmul/codes.py) becomes a CodedF32; a TiedEmbedding follows its
    head. Others stay as they are."""
    from pallas_kernels.f32_matmul.codes import encode
    from pallas_kernels.f32_matmul.cpu import PanelledF32

    names = MATMUL_WEIGHTS + tuple(fused for fused, _ in FUSED)
    for param in _matmul_params(model, names):
        value = param.get_value()
        if isinstance(value, PanelledF32):
            coded = encode(value)
            if coded is not None:
                param.set_value(coded)
    embed = getattr(model, "embed", None)
    if isinstance(embed, nnx.Variable) and isinstance(embed.get_value(), TiedEmbedding):
        embed.set_value(TiedEmbedding(model.lm_head.get_value()))
    return model


@jax.jit
def _panel(w: jax.Array) -> Any:
    """f32_matmul.cpu.panel compiled: its transposed copy is the only one made (eagerly,
    the 113 MB LM head passed through a second)."""
    from pallas_kernels.f32_matmul.cpu import panel

    return panel(w)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TiedEmbedding:
    """A tied model's embedding table read from its LM head (``head``: the [D, V] weight,
    its PanelledF32 or CodedF32), which holds the same numbers transposed: one copy instead of two
    (113 MB for SmolLM2 in float32); or a quantized model's table as its own codes
    (``code_embedding``: ``head`` is then the table's transpose, coded). Rows come out
    bitwise equal to the table's; or a tied int8 model's table read from its int8 LM head
    (``share_tied_table``: each row within half a quantization step of the table's)."""

    head: Any

    @property
    def shape(self) -> tuple[int, int]:
        d, v = self.head.shape
        return (v, d)

    @property
    def dtype(self) -> Any:
        return getattr(self.head, "dtype", jnp.dtype(jnp.float32))    # an int8 head's rows: float32

    def __getitem__(self, key: Any) -> "TiedEmbedding":
        """``param[...]`` (how a model reads its weights) returns the table itself."""
        if key is Ellipsis:
            return self
        raise TypeError("TiedEmbedding supports only [...] indexing")

    def rows(self, tokens: jax.Array) -> jax.Array:
        """tokens i32[T] -> [T, D]."""
        if hasattr(self.head, "columns_as_rows"):             # a PanelledF32 or CodedF32 head
            return self.head.columns_as_rows(tokens)
        return self.head[:, tokens].T


def tie_embedding(model: nnx.Module) -> nnx.Module:
    """In place: a tied float model's embedding becomes a TiedEmbedding over its LM head
    (once checked to hold the same numbers)."""
    embed = getattr(model, "embed", None)
    if not (model.cfg.tie_word_embeddings and isinstance(embed, nnx.Variable)):
        return model
    table, head = embed.get_value(), model.lm_head.get_value()
    if not isinstance(table, jax.Array) or hasattr(head, "scales") or head.shape != table.shape[::-1] \
            or head.dtype != table.dtype:
        return model
    panels = head.panelled().panels if hasattr(head, "codes") else getattr(head, "panels", head)
    if bool(_same_transposed(table, panels)):
        embed.set_value(TiedEmbedding(head))
    return model


@jax.jit
def _same_transposed(table: jax.Array, head: jax.Array) -> jax.Array:
    """table [V, D] == head.T, head given as [D, V] or as panels [V/P, D, P]."""
    if head.ndim == 3:
        head = head.transpose(1, 0, 2).reshape(head.shape[1], -1)
    return jnp.array_equal(table.T, head)


def prepare_for_engine(model: nnx.Module, mode: str | None, in_place: bool = False,
                       codes: bool = True) -> nnx.Module:
    """The single-device model as the engine runs it: quantized (``mode``; its float32
    embedding table kept as exact codes where it has them, ``codes``: ``code_embedding``),
    or a float32 model laid out for the CPU f32 kernel (``prepare_float_for_cpu``, ``codes``
    too)."""
    model = quantize_model(model, mode, in_place)
    if mode:
        model = share_tied_table(model)
        return code_embedding(model) if codes else model
    return prepare_float_for_cpu(model, in_place, codes)


def _head_from_table(table: jax.Array, quantized: Callable[[jax.Array], Any], step: int = 4096) -> Any:
    """A tied model's LM head (the table [V, D] transposed) quantized ``step`` rows of the
    table at a time: each column's codes and scale depend on that column alone, and the
    kernel's panels on their own 32 columns, so the result is the whole head's, and the
    transient is one transposed slab (9 MiB for SmolLM2), not a transposed table (113 MB)."""
    rows = np.asarray(table)
    parts = [quantized(jnp.asarray(np.ascontiguousarray(rows[v0:v0 + step].T))) for v0 in range(0, len(rows), step)]
    if len(parts) == 1:
        return parts[0]
    if len({p.panel for p in parts}) > 1:          # a last slab that does not fill a panel
        return quantized(table.T)
    return dataclasses.replace(parts[0], q=jnp.concatenate([p.q for p in parts], axis=0 if parts[0].panel else 1),
                               scales=jnp.concatenate([p.scales for p in parts]))


def share_tied_table(model: nnx.Module) -> nnx.Module:
    """In place: a tied model whose LM head is int8 reads its embedding rows from that head
    (a TiedEmbedding: each row its int8 codes times the row's scale, within half a step of
    the table's value) instead of keeping the table as well. Why: the int8 default model
    kept both, 27 MiB of int8 head and 34 MiB of table codes, the same numbers twice; mean
    KL(f32 || int8) over MT-Bench tails 0.00397 -> 0.00400 (RESULTS.md, "A first start as
    small as a later one").
    A table that is not within half a step of the head at sampled rows stays as it is."""
    embed = getattr(model, "embed", None)
    head = model.lm_head.get_value() if hasattr(model, "lm_head") else None
    if not (model.cfg.tie_word_embeddings and isinstance(embed, nnx.Variable)
            and getattr(head, "bits", None) == 8):
        return model
    table = embed.get_value()
    if isinstance(table, TiedEmbedding) or not isinstance(table, jax.Array) or table.shape != head.shape[::-1]:
        return model
    rows = np.unique(np.linspace(0, table.shape[0] - 1, 257).astype(np.int32))
    ours = np.asarray(head.columns_as_rows(jnp.asarray(rows)))
    step = np.asarray(head.scales)[rows][:, None]
    if not np.all(np.abs(np.asarray(table[rows], np.float32) - ours) <= step * (0.5 + 1e-5)):
        return model
    embed.set_value(TiedEmbedding(head))
    return model


def code_embedding(model: nnx.Module) -> nnx.Module:
    """In place: a float32 embedding table [V, D] whose values are exact block codes (a
    GGUF's Q8_0 token_embd, dequantized by the loader) becomes a TiedEmbedding over those
    codes (the table transposed, panelled and coded as the f32 kernel stores a head: its
    ``columns_as_rows`` gives the table's rows bitwise). Why: a quantized model's matmul
    weights are int8, but its embedding stayed float32, the largest array left (113 MB for
    SmolLM2; 32 MB as codes). Others stay as they are (CPU with the f32 kernel only)."""
    embed = getattr(model, "embed", None)
    if isinstance(embed, nnx.Variable):
        embed.set_value(coded_table(embed.get_value()))
    return model


def coded_table(table: Any) -> Any:
    """An embedding table as code_embedding keeps it: a TiedEmbedding over its exact codes,
    or the table itself where it has none (or is not a one-device float32 array on CPU)."""
    from jaxinfer.matmul import f32_kernel_applies
    from pallas_kernels.f32_matmul.codes import encode

    if not (isinstance(table, jax.Array) and table.ndim == 2 and f32_kernel_applies(table)
            and len(table.devices()) == 1):
        return table
    from pallas_kernels.f32_matmul.cpu import PANEL, CodedF32, PanelledF32

    V, D = table.shape
    if V % PANEL:                       # no panel layout: the table stays as it is
        return table
    # Coded a slab of rows at a time: each panel's codes depend on that panel alone, so the
    # result is the whole table's, and the transposed float copy is one slab (9 MiB), not
    # the table (113 MB for SmolLM2, the largest transient of a cold int8 load otherwise).
    rows = np.asarray(table)
    step = PANEL * 256
    parts = []
    for v0 in range(0, V, step):
        slab = rows[v0:v0 + step]
        panels = np.ascontiguousarray(slab.reshape(-1, PANEL, D).transpose(0, 2, 1))   # [n/16, D, 16]
        coded = encode(PanelledF32(jnp.asarray(panels)))
        if coded is None:
            return table
        parts.append(coded)
    if len(parts) == 1:
        return TiedEmbedding(parts[0])
    return TiedEmbedding(CodedF32(*(jnp.concatenate([getattr(c, f) for c in parts])
                                    for f in ("codes", "scale", "offset"))))


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
    """Bytes of every parameter array (quantized values and scales included; a layer loop's
    stacks, whose rows the parameters are, and an array two parameters share, such as a tied
    model's int8 head and its TiedEmbedding, once)."""
    import jax

    arrays = {id(x): x for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    return sum(x.size * x.dtype.itemsize for x in arrays.values())

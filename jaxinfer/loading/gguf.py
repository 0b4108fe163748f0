"""Load a GGUF checkpoint (llama.cpp's format) into HF-named numpy arrays.

``load_gguf(path)`` memory-maps the file, dequantizes every tensor with the ``gguf``
package's own decoders (F32/F16/BF16, Q4_0..Q8_0, K-quants, IQ*), renames them to the
HF transformers names and layout (``[out_features, in_features]``), rebuilds an HF-style
``config.json`` dict from the metadata, and builds the tokenizer from the stored vocabulary.
Nothing is unpickled or executed.

Layout: ggml lists dimensions fastest-first, so a GGUF ``[in, out]`` weight is the numpy
(C-order) array ``[out, in]`` -- already HF's layout. The one reordering to undo is
llama.cpp's converter permuting the rows of q and k of llama-arch models (it turns HF's
"rotate halves" rotary into ggml's interleaved-pairs rotary); qwen2/qwen3 are stored as is.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize as _gguf_dequantize

from jaxinfer.loading import gguf_gpt
from jaxinfer.loading.lazy import LazyTensors
from jaxinfer.loading.tokenizer import Tokenizer

# GGUF `general.architecture` -> HF `architectures[0]` / `model_type`; the GPT-style ones
# (gpt2, gptneox, bloom, falcon, starcoder, mpt) are read by loading/gguf_gpt.py.
SUPPORTED_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    **gguf_gpt.ARCHS,
}

# GGUF tensor name -> HF name. `{i}` is the layer; `.weight` / `.bias` suffixes carry over.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per-architecture renames on top of _LAYER_NAMES (Gemma 3's four norms per layer).
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp's converter stores Gemma's RMSNorm weights as w + 1 (what the kernel multiplies
# by); HF keeps w and adds 1 in the forward. Loading undoes it (as transformers' own GGUF
# loader does), so every checkpoint reaches the model in HF's convention.
_NORM_PLUS_ONE = ("gemma3",)
# Gemma 3's chat template (the text turns of google/gemma-3's tokenizer_config.json): llama.cpp
# files often carry none, and llama.cpp then formats Gemma chats this same way.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_DEFAULT_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# Consumed into the config (llama3 rotary scaling factors), not a model weight.
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    """A loaded GGUF: HF-style config dict, HF-named tensors (dequantized when read, each
    time it is read: loading/lazy.py), tokenizer, generation defaults."""

    config: dict
    tensors: LazyTensors
    tokenizer: Tokenizer
    generation_config: dict


def load_gguf(path: str, dtype: Any = np.float32) -> GGUFCheckpoint:
    """Read ``path`` and return its config, dequantized ``dtype`` tensors and tokenizer.

    Raises FileNotFoundError (no such file), ValueError (not a GGUF / corrupt, unsupported
    architecture, tokenizer or tensor type, shapes that contradict the metadata).
    """
    reader, arch = _open_supported(path)
    meta = _metadata(reader)
    infos = {t.name: t for t in reader.tensors}
    _check_types(path, reader.tensors)
    config = _config(path, arch, meta, infos)
    if arch in _DEFAULT_CHAT_TEMPLATES and not meta.get("tokenizer.chat_template"):
        meta["tokenizer.chat_template"] = _DEFAULT_CHAT_TEMPLATES[arch]
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    config["vocab_size"] = config.get("vocab_size") or tokenizer.vocab_size

    gpt = arch in gguf_gpt.ARCHS
    if gpt:
        names = gguf_gpt.hf_names(path, arch, config, list(infos))
    else:
        names = {name: _hf_name(path, name, config["num_hidden_layers"], arch)
                 for name in infos if name != _ROPE_FREQS}
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = arch == "llama"

    def convert(name: str) -> np.ndarray:
        w = _dequantize(infos[name])
        if gpt:
            w = gguf_gpt.to_hf_layout(arch, config, name, w)
        if permute and (".attn_q." in name or ".attn_k." in name):
            w = _unpermute_rows(w, heads if ".attn_q." in name else kv_heads)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w.astype(np.float32) - np.float32(1.0)
        w = w.astype(dtype, copy=False)
        # F32 tensors come back as views of the read-only mmap; own the memory instead.
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, order="C")
        return w

    # Dequantized one at a time as the model is built (loading/lazy.py); serial on
    # purpose: a thread pool measured slower (the numpy dequantizers are memory-bound and
    # mostly hold the GIL between their many small ops).
    gguf_name = {hf: name for name, hf in names.items()}
    if not gpt:       # (the GPT families' shapes are checked against their weight table)
        _check_shapes(path, config, {hf: _shape(infos[name]) for name, hf in names.items()})
    tensors = LazyTensors(list(gguf_name), lambda hf: convert(gguf_name[hf]))
    return GGUFCheckpoint(config=config, tensors=tensors, tokenizer=tokenizer,
                          generation_config=_generation_config(meta, config, tokenizer))


def read_gguf_config(path: str) -> dict[str, Any]:
    """The HF-style config of a GGUF file from its metadata alone (no tensor is read)."""
    reader, arch = _open_supported(path)
    meta = _metadata(reader)
    config = _config(path, arch, meta, {t.name: t for t in reader.tensors})
    if not config.get("vocab_size"):
        config["vocab_size"] = Tokenizer.from_gguf_metadata(meta).vocab_size
    return config


def _open_supported(path: str) -> tuple[Any, str]:
    """The reader and the architecture name; ValueError for an architecture we do not run."""
    reader = open_gguf(path)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    return reader, arch


def open_gguf(path: str) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` with errors that name the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _FastReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError on bad bytes
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


class _FastReader(gguf.GGUFReader):
    """GGUFReader whose metadata fields are decoded straight into Python values.

    gguf's reader makes a numpy view of the file for every metadata string and number
    (~250k for a 49k-token vocabulary with its merges): ~1.1-1.3 s on the 2-core Zen 3 VM,
    ~4 s on a first start, where it shares the cores with the C++ kernel builds. Here a
    field is read with ``int.from_bytes`` / ``bytes.decode`` (arrays of numbers with one
    ``np.frombuffer``): ~0.1 s. The fields answer ``contents()`` as gguf's do (arrays
    flattened, strings strict UTF-8); tensor infos and data stay gguf's. A plain ndarray
    view of the memmap (slicing an ``np.memmap`` costs ~3x: ``__array_finalize__``) keeps the
    mapping alive; no tensor bytes are read until used. Byte-swapped files take gguf's path.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return super()._build_fields(offs, count)
        buf = self._plain
        for _ in range(int(count)):
            start = offs
            key, offs = _read_str(buf, offs)
            vtype = gguf.GGUFValueType(_read_uint(buf, offs, 4))
            value, types, offs, last = _read_value(buf, offs + 4, vtype)
            self._push_field(_Field(start, key, value, types, last), skip_sum=True)
        return offs


class _Field:
    """One decoded metadata field: ``contents()`` as gguf.ReaderField's; ``types`` and
    ``parts[-1]`` (a scalar's numpy value, which the reader itself reads for
    general.alignment) as there."""

    def __init__(self, offset: int, name: str, value: Any, types: list, last: Any):
        self.offset, self.name, self._value, self.types = offset, name, value, types
        self.parts = [last]

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if isinstance(self._value, list):
            return self._value[index_or_slice]
        return self._value


_SCALARS = {gguf.GGUFValueType.UINT8: "<u1", gguf.GGUFValueType.INT8: "<i1", gguf.GGUFValueType.UINT16: "<u2",
            gguf.GGUFValueType.INT16: "<i2", gguf.GGUFValueType.UINT32: "<u4", gguf.GGUFValueType.INT32: "<i4",
            gguf.GGUFValueType.FLOAT32: "<f4", gguf.GGUFValueType.UINT64: "<u8", gguf.GGUFValueType.INT64: "<i8",
            gguf.GGUFValueType.FLOAT64: "<f8", gguf.GGUFValueType.BOOL: "?"}


def _read_uint(buf: np.ndarray, offs: int, n: int) -> int:
    end = offs + n
    if end > len(buf):
        raise ValueError(f"truncated metadata at byte {offs}")
    return int.from_bytes(buf[offs:end].tobytes(), "little")


def _read_str(buf: np.ndarray, offs: int) -> tuple[str, int]:
    n = _read_uint(buf, offs, 8)
    end = offs + 8 + n
    if end > len(buf):
        raise ValueError(f"truncated string at byte {offs}")
    return buf[offs + 8:end].tobytes().decode("utf-8"), end


def _read_value(buf: np.ndarray, offs: int, vtype: Any) -> tuple[Any, list, int, Any]:
    """(value, types, offset after it, its last part) of one metadata value at ``offs``:
    a str, a number, or a flat list (gguf's reader flattens nested arrays too)."""
    if vtype == gguf.GGUFValueType.STRING:
        value, end = _read_str(buf, offs)
        return value, [vtype], end, None
    if vtype in _SCALARS:
        arr = np.frombuffer(buf, _SCALARS[vtype], 1, offs)
        return arr.tolist()[0], [vtype], offs + arr.nbytes, arr
    if vtype != gguf.GGUFValueType.ARRAY:
        raise ValueError(f"unknown metadata type {vtype}")
    itype = gguf.GGUFValueType(_read_uint(buf, offs, 4))
    n = _read_uint(buf, offs + 4, 8)
    offs += 12
    types: list = [vtype]
    if itype in _SCALARS:
        arr = np.frombuffer(buf, _SCALARS[itype], n, offs)
        return arr.tolist(), types + [itype] * bool(n), offs + arr.nbytes, None
    out: list = []
    for i in range(n):
        value, sub, offs, _ = _read_value(buf, offs, itype)
        if i == 0:
            types += sub
        if isinstance(value, list):
            out += value
        else:
            out.append(value)
    return out, types, offs, None


def _metadata(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


# --------------------------------------------------------------------- tensors
def _supported_types() -> set:
    from gguf.quants import _type_traits  # the types gguf.quants.dequantize implements

    return {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *_type_traits}


def _check_types(path: str, tensors: list) -> None:
    ok = _supported_types()
    for t in tensors:
        if t.tensor_type not in ok:
            raise ValueError(f"{path}: tensor {t.name!r} has quantization type "
                             f"{t.tensor_type.name}, which cannot be dequantized "
                             f"(supported: {', '.join(sorted(x.name for x in ok))})")


def _shape(info: Any) -> tuple[int, ...]:
    """A tensor's numpy (C-order) shape: ggml lists dimensions fastest-first."""
    return tuple(int(d) for d in reversed(info.shape.tolist()))


def _dequantize(info: Any) -> np.ndarray:
    w = _gguf_dequantize(info.data, info.tensor_type)
    # The reader already shapes block data to (rows, bytes); the result is (rows, cols).
    want = _shape(info)
    if w.shape != want:
        w = w.reshape(want)
    return w


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf).

    The converter reshaped rows as [head, 2, dim/2] and swapped the middle axes; reading
    rows as [head, dim/2, 2] and swapping back restores HF's order. Same as
    transformers' ``LlamaTensorProcessor._reverse_permute_weights`` (q uses num_heads, k
    num_key_value_heads); it also applies to biases (1-D)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(path: str, name: str, num_layers: int, arch: str = "llama") -> str:
    m = _LAYER_RE.match(name)
    if m:
        layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if part in names and layer < num_layers:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    else:
        m = _GLOBAL_RE.match(name)
        if m and m.group(1) in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"{path}: unexpected tensor {name!r} (not part of a supported "
                     f"{'/'.join(SUPPORTED_ARCHS)} decoder)")


def _check_shapes(path: str, c: dict, tensors: dict[str, tuple[int, ...]]) -> None:
    """``tensors``: HF name -> shape."""
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    want = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,),
            "lm_head.weight": (c["vocab_size"], d)}
    per_layer = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (d,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
    }
    for i in range(c["num_hidden_layers"]):
        want.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    for name, shape in tensors.items():
        if name in want and shape != want[name]:
            raise ValueError(f"{path}: tensor {name} has shape {shape}, the metadata "
                             f"implies {want[name]}")
    required = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{k}" for i in range(c["num_hidden_layers"])
        for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight")]
    if c.get("architectures") == ["Gemma3ForCausalLM"]:
        required += [f"model.layers.{i}.{k}" for i in range(c["num_hidden_layers"])
                     for k in ("self_attn.q_norm.weight", "self_attn.k_norm.weight",
                               "pre_feedforward_layernorm.weight",
                               "post_feedforward_layernorm.weight")]
    if c.get("architectures") == ["Qwen3ForCausalLM"]:
        required += [f"model.layers.{i}.self_attn.{k}_norm.weight"
                     for i in range(c["num_hidden_layers"]) for k in "qk"]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


# --------------------------------------------------------------------- config
def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06): what the original config.json said."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def _config(path: str, arch: str, meta: dict, infos: dict) -> dict:
    if arch in gguf_gpt.ARCHS:
        return gguf_gpt.config(path, arch, meta, infos)
    hf_arch, model_type = SUPPORTED_ARCHS[arch]

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if v is None and required:
            raise ValueError(f"{path}: metadata key {arch}.{name} is missing")
        return v

    def one(name: str, v: Any) -> int:
        if isinstance(v, list):  # some converters write per-layer counts
            if len(set(v)) != 1:
                raise ValueError(f"{path}: {arch}.{name} varies per layer ({v}); not supported")
            v = v[0]
        return int(v)

    hidden = int(key("embedding_length"))
    heads = one("attention.head_count", key("attention.head_count"))
    kv_heads = one("attention.head_count_kv", key("attention.head_count_kv", heads))
    head_dim = key("attention.key_length", None, required=False)
    if head_dim is None and arch == "llama":
        head_dim = key("rope.dimension_count", None, required=False)
    head_dim = int(head_dim or hidden // heads)
    emb = infos.get("token_embd.weight")
    vocab = int(emb.shape[1]) if emb is not None else key("vocab_size", None, required=False)
    theta = _f32(key("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab) if vocab else None,
        "hidden_size": hidden,
        "intermediate_size": one("feed_forward_length", key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in infos,
        "hidden_act": "silu",
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in infos or "blk.0.attn_output.bias" in infos
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in infos
    scaling = _rope_scaling(path, arch, meta, infos, theta, head_dim)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch == "gemma3":
        cfg.update(_gemma3_config(path, meta, cfg))
    return cfg


def _gemma3_config(path: str, meta: dict, cfg: dict) -> dict:
    """What llama.cpp's gemma3 loader fixes rather than stores: every 6th layer global
    (unless the file lists the pattern), local rotary base 10000, softmax scale 1/sqrt of
    head_dim (of hidden/heads for the 62-layer 27B), gelu-tanh MLP."""
    n = cfg["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):      # per-layer flags: true = sliding
        if len(pattern) != n:
            raise ValueError(f"{path}: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {n} layers")
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        p = int(pattern)
        types = ["sliding_attention" if p and (i + 1) % p else "full_attention" for i in range(n)]
    qpas = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out = {"layer_types": types, "query_pre_attn_scalar": qpas,
           "rope_local_base_freq": _f32(meta.get("gemma3.rope.local.freq_base", 10000.0)),
           "hidden_activation": "gelu_pytorch_tanh"}
    window = meta.get("gemma3.attention.sliding_window")
    if window is not None:
        out["sliding_window"] = int(window)
    return out


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _rope_scaling(path: str, arch: str, meta: dict, infos: dict, theta: float,
                  head_dim: int) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if _ROPE_FREQS in infos:
        return _llama3_scaling_from_freqs(path, infos[_ROPE_FREQS], theta, head_dim)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    out: dict[str, Any] = {"rope_type": str(kind)}
    if factor is not None:
        out["factor"] = _f32(factor)
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 rotary scaling, as llama.cpp stores them in
    ``rope_freqs.weight`` (1 for high frequencies, ``factor`` for low, smooth between)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wl = original_max_position_embeddings / low_freq_factor
    high_wl = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, mid))


def _llama3_scaling_from_freqs(path: str, info: Any, theta: float, head_dim: int) -> dict:
    """GGUF keeps Llama 3.1 rope scaling only as the factors tensor; recover the HF
    parameters by matching it against the standard parameterisation."""
    got = np.asarray(_dequantize(info), dtype=np.float64).reshape(-1)
    factor = float(got.max())
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384)):
        want = llama3_rope_factors(theta, head_dim, factor, low, high, orig)
        if want.shape == got.shape and np.allclose(got, want, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise ValueError(f"{path}: rope_freqs.weight does not match Llama 3 rope scaling with "
                     f"factor {factor}; this rotary scaling is not supported")


def _generation_config(meta: dict, config: dict, tok: Tokenizer) -> dict:
    eos = list(tok.eos_token_ids)
    gen: dict[str, Any] = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.get("pad_token_id"),
    }
    # Newer llama.cpp converters copy the model's recommended sampling into general.sampling.*
    for gguf_key, hf_key in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                             ("min_p", "min_p"), ("penalty_repeat", "repetition_penalty")):
        v = meta.get(f"general.sampling.{gguf_key}")
        if v is not None:
            gen[hf_key] = int(v) if hf_key == "top_k" else _f32(v)
    if "temperature" in gen:
        gen["do_sample"] = gen["temperature"] > 0
    return {k: v for k, v in gen.items() if v is not None}

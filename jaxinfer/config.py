"""Frozen configuration records: the model's shape and a request's sampling parameters.

Everything here is plain data, validated once in ``__post_init__`` with errors that name
the offending field. Nothing below the CLI reads environment variables; they all take
these records instead.

Static vs runtime: every ``ModelConfig`` field changes compiled shapes or code (it is a
static argument of the jitted step). ``SamplingParams`` never does: the sampler receives
its values as per-row arrays, so any mix of requests shares one executable.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

# HF `architectures` names that the Llama-family model file serves (see models/registry.py).
LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Activations a model's MLP may name (models/layers.py ``activation``); "gelu_new" is
# GPT-2's name for the tanh approximation.
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
# HF `layer_types` entries ModelConfig understands (see ModelConfig.layer_window).
LAYER_TYPES = ("full_attention", "sliding_attention")
# RopeScaling.rope_type values models/layers.rope_inv_freq implements.
ROPE_TYPES = ("llama3", "linear", "longrope", "default")


def draft_quantization(c: "EngineConfig", int4_kernel: bool) -> str | None:
    """The draft's weight quantization, ``speculative_quantization`` with "auto" resolved:
    int4 for a quantized target (int8 would not be cheaper than an int8 one) and where the
    CPU kernel's 4-bit panels run (``int4_kernel``: on this VM they draft faster and agree
    more than int8, RESULTS.md "A 4-bit draft on a C++ kernel"), else int8 (an accelerator's
    int4 is symmetric per group of 64: 41% of its drafts agreed)."""
    q = c.speculative_quantization
    if q != "auto":
        return q
    return "int4" if c.quantization is not None or int4_kernel else "int8"


def kv_cache_dtype(c: "EngineConfig") -> str | None:
    """The KV pages' dtype, ``kv_cache_dtype`` with "auto" (None) resolved: "int8" or None
    (the model's dtype). "auto" stores int8 pages when the weights are quantized: a user who
    asks for quantized weights asks for a small footprint, and at the default model's
    32-request workload float32 pages are 0.36 GB, int8 pages 0.09 GB (the int8 server
    peaks at 565-619 MiB instead of ~0.9 GB: RESULTS.md "int8 KV pages by default"); int8
    pages add ~0.0008 to the int8 weights' mean KL of 0.0037 (RESULTS.md "Start-up beside
    llama.cpp and vLLM").
    ``kv_cache_dtype="model"`` keeps the model's dtype. Speculative decoding keeps the
    model's dtype under "auto": a user who asks for it asks for speed, and on an int8 model
    int8 pages took it from 1.10x to 0.96x (RESULTS.md "Speculation on an int8 target with
    its default int8 KV pages")."""
    d = c.kv_cache_dtype
    if d in (None, "auto"):
        return "int8" if c.quantization is not None and c.speculative_method is None else None
    return None if d == "model" else d


INT32_MAX = 2**31 - 1            # the device's token / count arrays are int32
MAX_TEMPERATURE = 1e4             # beyond it every row is uniform anyway (float32 logits / t)
MAX_REPETITION_PENALTY = 1e4
MAX_LENGTH_PENALTY = 10.0


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True, slots=True)
class Bound:
    """A numeric request field's range, declared once: ``SamplingParams`` enforces it, the
    HTTP parsers read it, and the server's OpenAPI schema publishes it."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False            # lo itself excluded
    note: str = ""                   # what special values mean

    def ok(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(v):
            return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return lo_ok and (self.hi is None or v <= self.hi)

    def text(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo, hi = _num_text(self.lo), _num_text(self.hi)
        if self.lo is not None and self.hi is not None:
            rng = f" in {'(' if self.lo_open else '['}{lo}, {hi}]"
        elif self.lo is not None:
            rng = f" {'>' if self.lo_open else '>='} {lo}"
        else:
            rng = f" <= {hi}" if self.hi is not None else ""
        return kind + rng + (f" ({self.note})" if self.note else "")

    def schema(self) -> dict[str, Any]:
        """JSON-schema keywords for this range."""
        out: dict[str, Any] = {"type": "integer" if self.integer else "number"}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


def _num_text(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling: ``llama3`` (Llama 3.1+), ``linear`` and ``longrope``
    (Phi-3: per-frequency divisors, ``short_factor`` or ``long_factor``, and cos / sin
    scaled by ``attention_factor``).

    Longrope: transformers uses the long factors for a forward whose sequence passes
    original_max_position_embeddings and the short ones otherwise, so a token's rotation
    there depends on how long its sequence has grown (and on what shares its forward). We
    pick one set per engine instead (``use_long``; models/base.fit_context): the long
    factors when the engine's max_model_len exceeds original_max_position_embeddings,
    else the short ones. Both agree with transformers where its own choice is the same."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    use_long: bool = False

    def __post_init__(self) -> None:
        _require(self.rope_type in ROPE_TYPES, "rope_scaling.rope_type",
                 f"unsupported rope scaling {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        _require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")
        if self.rope_type == "longrope":
            _require(len(self.short_factor) > 0 and len(self.short_factor) == len(self.long_factor),
                     "rope_scaling.short_factor", "longrope needs short_factor and long_factor lists "
                     f"of one length (got {len(self.short_factor)} and {len(self.long_factor)})")
            _require(all(f > 0 for f in self.short_factor + self.long_factor), "rope_scaling.long_factor",
                     "longrope factors must be > 0")
            _require(self.attention_factor > 0, "rope_scaling.attention_factor",
                     f"must be > 0, got {self.attention_factor}")

    @property
    def ext_factors(self) -> tuple[float, ...]:
        """Longrope's divisors of the inverse frequencies in use."""
        return self.long_factor if self.use_long else self.short_factor


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer of the Llama family.

    Names follow HF ``config.json`` where one exists; ``models.registry.config_from_hf`` maps the rest.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2: bias on q/k/v; Llama `attention_bias`: on q/k/v/o
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention (Gemma 2/3): HF's `layer_types` ("sliding_attention" layers use
    # `sliding_window`, "full_attention" layers see everything); None: every layer uses
    # `sliding_window`. Read through `layer_window` / `attention_kwargs`, never directly.
    layer_types: tuple[str, ...] | None = None
    attn_scale: float | None = None      # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None   # scores -> cap * tanh(scores / cap) (attn_logit_softcapping)
    final_soft_cap: float | None = None  # the same on the logits (final_logit_softcapping)
    rope_local_theta: float | None = None  # rotary base of sliding layers (rope_local_base_freq)
    gpt: Any = None                 # models/gpt_config.GptStyle for the GPT-style families, else None
    rotary_dim: int | None = None   # features per head that rotate (Phi-3's partial_rotary_factor); None: all
    moe: Any = None                 # models/moe_config.MoeStyle for mixture-of-experts models, else None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
                 f"num_attention_heads ({self.num_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_kv_heads})")
        _require(self.head_dim % 2 == 0, "head_dim", f"must be even for rotary, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.hidden_act in ACTIVATIONS, "hidden_act",
                 f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        _require(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
                 f"must be a positive integer or null, got {self.sliding_window!r}")
        if self.layer_types is not None:
            _require(len(self.layer_types) == self.num_layers, "layer_types",
                     f"has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            _require(not bad, "layer_types", f"unsupported layer type(s) {bad} (supported: "
                     f"{', '.join(LAYER_TYPES)})")
            _require("sliding_attention" not in self.layer_types or self.sliding_window is not None,
                     "sliding_window", "layer_types has sliding_attention layers but no window")
        rd = self.rotary_dim
        _require(rd is None or (isinstance(rd, int) and 0 < rd <= self.head_dim and rd % 2 == 0),
                 "partial_rotary_factor", f"rotates {rd} features per head: must be even and in "
                 f"(0, head_dim={self.head_dim}]")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            _require(len(rs.short_factor) == (rd or self.head_dim) // 2, "rope_scaling.short_factor",
                     f"has {len(rs.short_factor)} entries, expected rotated features / 2 = "
                     f"{(rd or self.head_dim) // 2}")
        for name in ("attn_scale", "attn_soft_cap", "final_soft_cap", "rope_local_theta"):
            v = getattr(self, name)
            _require(v is None or v > 0, name, f"must be > 0 or null, got {v!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> tuple[float, "RopeScaling | None"]:
        """(rotary base, scaling) of layer ``layer``: sliding layers use ``rope_local_theta``
        unscaled when it is set (Gemma 3), every other layer rope_theta / rope_scaling."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def attention_kwargs(self, layer: int) -> dict[str, Any]:
        """The static keyword arguments every attention implementation takes for ``layer``
        (pallas_kernels/attention/xla.py's signature): the one place a layer's attention options are read."""
        return {"sm_scale": self.sm_scale, "sliding_window": self.layer_window(layer),
                "soft_cap": self.attn_soft_cap}


def hf_common_fields(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of an HF config.json dict as the Llama family reads them; other
    families start from these and override/add their own."""
    def need(key: str) -> Any:
        if key not in d or d[key] is None:
            raise ValueError(f"{key}: missing from config.json (required for {arch})")
        return d[key]

    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = d.get("head_dim") or hidden // num_heads
    rs = d.get("rope_scaling") or None
    if rs is None and isinstance(d.get("rope_parameters"), Mapping):
        # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rp = d["rope_parameters"]
        if rp.get("rope_type", "default") != "default":
            rs = rp
    scaling = None
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "longrope":
            scaling = _longrope(d, rs)
        elif rtype not in (None, "default"):
            scaling = RopeScaling(
                rope_type=rtype,
                factor=float(rs.get("factor", 1.0)),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rs.get("original_max_position_embeddings", 8192)),
            )
    theta = d.get("rope_theta")
    if theta is None and isinstance(d.get("rope_parameters"), Mapping):
        theta = d["rope_parameters"].get("rope_theta")
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attn_bias = bool(d.get("attention_bias", False))
    sliding = None
    if arch == "MistralForCausalLM":
        sliding = d.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and d.get("use_sliding_window"):
        raise ValueError("use_sliding_window: Qwen sliding-window layers are not supported")
    return dict(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attn_bias,
        o_bias=attn_bias and not is_qwen2,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding) if sliding else None,
        hidden_act=str(d.get("hidden_act", "silu")),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def _longrope(d: Mapping[str, Any], rs: Mapping[str, Any]) -> RopeScaling:
    """Longrope's fields as transformers reads them: a top-level
    original_max_position_embeddings wins (Phi-3 keeps it there); ``factor`` defaults to
    max_position_embeddings / original; ``attention_factor`` to sqrt(1 + ln factor / ln
    original) (1 where factor <= 1)."""
    orig = int(d.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
               or d.get("max_position_embeddings", 2048))
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else d.get("max_position_embeddings", orig) / orig
    att = rs.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def factors(key: str) -> tuple[float, ...]:
        v = rs.get(key)
        _require(isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v),
                 f"rope_scaling.{key}", f"longrope needs a list of numbers, got {v!r:.80}")
        return tuple(float(x) for x in v)

    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=orig,
                       short_factor=factors("short_factor"), long_factor=factors("long_factor"),
                       attention_factor=float(att))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling parameters, named as in vLLM / the OpenAI API.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. Penalties follow vLLM: ``repetition_penalty`` (HF/CTRL style, divides positive
    logits of every token seen in prompt or output) and OpenAI's ``presence_penalty`` /
    ``frequency_penalty`` (subtracted, counting output tokens only). ``logprobs=k`` returns
    the chosen token's log-probability and the k most likely alternatives, computed from
    the model's raw distribution (before temperature and filters), as vLLM does.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding (jaxinfer/engine/guided.py): a GuidedDecoding or a dict with one
    # key (json / json_object / regex / choice / grammar); token id -> bias added to the
    # logit (a dict or (id, bias) pairs); EOS / stop ids banned for the first min_tokens;
    # strings whose token sequences may not be generated.
    guided: Any = None
    logit_bias: Any = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    # Prefix caching (vLLM's cache_salt): requests share cached KV pages only with requests
    # of the same salt, so tenants who must not see each other's timing don't share.
    cache_salt: str | None = None
    # Scoring and search (engine/scoring.py, engine/beam.py, engine/watermark.py):
    # prompt_logprobs=k: every prompt token's logprob and the top k alternatives (vLLM);
    # with it max_tokens may be 0 (score the prompt, generate nothing). best_of: sample
    # that many, return the n with the highest cumulative logprob. beam_width > 1: beam
    # search (HF generate's num_beams), its n best hypotheses returned, ranked by
    # cumulative logprob / generated_length ** length_penalty; early_stopping True /
    # False / "never" as in HF. watermark: True, {"gamma": g, "delta": d} or a
    # watermark.Watermark.
    prompt_logprobs: int | None = None
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    watermark: Any = None

    MAX_LOGPROBS = 20
    MAX_BEAM_WIDTH = 10        # 2 * width candidates per beam must fit the top-MAX_LOGPROBS
    MAX_CACHE_SALT_CHARS = 1024
    MAX_SAMPLES = 1024         # n / best_of: sequences of one request (the engine's max_num_seqs caps it too)
    # The numeric fields' ranges (Bound), each closed on both sides: every value reaches an
    # int32 / float32 device array or a float power, so an open end is a crash waiting for
    # a client (2**31 in top_k, 1e308 in length_penalty). min_tokens is also capped by
    # max_tokens, top_k by the vocabulary (Engine.add_request; the server when parsing).
    BOUNDS = {
        "n": Bound(True, 1, MAX_SAMPLES), "max_tokens": Bound(True, 1, INT32_MAX),
        "temperature": Bound(False, 0, MAX_TEMPERATURE, note="0: greedy"),
        "top_p": Bound(False, 0, 1, lo_open=True),
        "top_k": Bound(True, -1, INT32_MAX, note="0 or -1: disabled; at most the vocabulary size"),
        "min_p": Bound(False, 0, 1), "repetition_penalty": Bound(False, 0, MAX_REPETITION_PENALTY, lo_open=True),
        "presence_penalty": Bound(False, -2, 2), "frequency_penalty": Bound(False, -2, 2),
        "logprobs": Bound(True, 0, MAX_LOGPROBS), "min_tokens": Bound(True, 0, INT32_MAX),
        "prompt_logprobs": Bound(True, 0, MAX_LOGPROBS), "best_of": Bound(True, 1, MAX_SAMPLES),
        "beam_width": Bound(True, 1, MAX_BEAM_WIDTH, note="1: no beam search"),
        # generated_length ** length_penalty stays finite (and non-zero) for any length up
        # to 2**20 tokens; HF's and vLLM's defaults live in [0, 2]
        "length_penalty": Bound(False, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
        "seed": Bound(True, -2**63, 2**63 - 1, note="64 bits"),
    }
    _OPTIONAL = ("logprobs", "prompt_logprobs", "best_of", "seed")     # None: off

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty is set (the device keeps penalty
        state for the sequence)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def __post_init__(self) -> None:
        # Accept lists / single strings for convenience but store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name, bound in self.BOUNDS.items():
            v = getattr(self, name)
            if name == "max_tokens" and v == 0 and self.prompt_logprobs is not None:
                continue                     # scoring only: the prompt's logprobs, no output
            if not (name in self._OPTIONAL and v is None):
                _require(bound.ok(v), name, f"must be {bound.text()}, got {v!r:.80}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"must be non-empty strings, got {self.stop!r}")
        _require(all(isinstance(t, int) and 0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
                 f"must be token ids (integers in [0, {INT32_MAX}]), got {self.stop_token_ids!r:.80}")
        _require(self.cache_salt is None or (isinstance(self.cache_salt, str)
                 and 0 < len(self.cache_salt) <= self.MAX_CACHE_SALT_CHARS), "cache_salt",
                 f"must be a non-empty string of at most {self.MAX_CACHE_SALT_CHARS} characters or None, "
                 f"got {self.cache_salt!r:.80}")
        self._check_constraints()
        self._check_search()

    def _check_search(self) -> None:
        """prompt_logprobs, best_of, beam search, watermark, and the combinations not served."""
        from jaxinfer.engine.watermark import Watermark

        object.__setattr__(self, "watermark", Watermark.parse(self.watermark))
        if self.max_tokens == 0:
            _require(self.n == 1 and self.best_of is None and self.beam_width == 1, "max_tokens",
                     "0 (score the prompt only) takes n=1, no best_of and no beam search")
        if self.best_of is not None:
            _require(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
            _require(self.best_of == 1 or self.temperature > 0, "best_of",
                     "must be 1 with greedy sampling (temperature 0): every sample would be the same")
        _require(self.early_stopping in (True, False, "never"), "early_stopping",
                 f"must be true, false or \"never\", got {self.early_stopping!r}")
        if self.beam_width > 1:
            self._check_beam()

    def _check_beam(self) -> None:
        """Beam search is deterministic (HF's num_beams without do_sample) over the raw
        log-probabilities: options that would change them or need sampling are refused."""
        _require(self.n <= self.beam_width, "n", f"must be <= beam_width={self.beam_width} with beam search, "
                 f"got {self.n}")
        _require(self.temperature == 0, "temperature", "must be 0 with beam search (it is deterministic)")
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            _require(getattr(self, name) in (off, -1 if name == "top_k" else off), name,
                     "is not supported with beam search")
        for name in ("best_of", "logprobs", "watermark"):
            _require(getattr(self, name) is None, name, "is not supported with beam search")
        _require(not self.stop, "stop", "stop strings are not supported with beam search (stop_token_ids are)")
        _require(not self.constrained, "guided", "guided decoding, logit_bias, min_tokens and bad_words are "
                 "not supported with beam search")

    def _check_constraints(self) -> None:
        from jaxinfer.engine import guided as G

        if self.guided is not None:
            object.__setattr__(self, "guided", G.GuidedDecoding.parse(self.guided))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: expected a map of token id -> number, got {self.logit_bias!r:.80}") from None
        _require(len(bias) <= G.MAX_LOGIT_BIAS, "logit_bias",
                 f"at most {G.MAX_LOGIT_BIAS} entries, got {len(bias)}")
        _require(all(i >= 0 and math.isfinite(v) and -100 <= v <= 100 for i, v in bias), "logit_bias",
                 "token ids must be >= 0 and biases numbers in [-100, 100]")
        _require(len({i for i, _ in bias}) == len(bias), "logit_bias", "a token id appears twice")
        object.__setattr__(self, "logit_bias", bias)
        _require(self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        _require(len(words) <= G.MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() for w in words),
                 "bad_words", f"must be at most {G.MAX_BAD_WORDS} non-empty strings, got {self.bad_words!r:.80}")
        object.__setattr__(self, "bad_words", words)

    @property
    def constrained(self) -> bool:
        """Whether the sampler's token mask has work for this request."""
        return self.guided is not None or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Logprob:
    """One sampled position: the chosen token's log-probability and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` samples of a request (cumulative so far)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None (running)
    stop_reason: str | int | None = None      # the stop string or token id that ended it
    logprobs: list[Logprob] | None = None
    # Sum of the chosen tokens' logprobs (best_of and beam search; else None). Beam
    # search also reports HF's sequence score: cumulative_logprob / length ** length_penalty.
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of a request's life, for serving metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What ``Engine.generate`` returns per prompt, and ``AsyncEngine`` yields as it grows."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context); filled once the prompt is computed.
    prompt_logprobs: list[Logprob | None] | None = None


DEFAULT_COMPILATION_CACHE = "~/.cache/jaxinfer/xla"
DEFAULT_WEIGHT_CACHE = "~/.cache/jaxinfer/weights"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model: KV cache size, batching limits, buckets, mesh.

    Static (changes compiled shapes): page_size, num_pages, max_num_seqs, the bucket
    ladders (derived from the limits unless given), dtype, tensor/data parallel sizes.
    Everything else is host-side policy.
    """

    dtype: str = "float32"
    page_size: int = 16
    kv_cache_memory: int | None = None       # bytes for K and V pages, all layers
    # Without kv_cache_memory: this fraction of the device's free memory where the backend
    # reports it (GPU/TPU), else DEFAULT_KV_CACHE_MEMORY (CPU).
    kv_cache_memory_fraction: float = 0.9
    num_pages: int | None = None             # overrides kv_cache_memory (tests)
    max_num_seqs: int = 64                   # sequences in one step
    max_num_batched_tokens: int = 512        # tokens in one step (chunked prefill budget)
    max_model_len: int | None = None         # prompt + output; default min(model's, 4096)
    max_waiting: int | None = 4096           # waiting sequences before QueueFullError
    # Prefix caching (engine/block_manager.py): full computed KV pages are kept, found by
    # chain hash and shared by later requests with the same prefix; evicted LRU.
    enable_prefix_caching: bool = True
    # Host-memory tier behind the prefix cache: bytes of host RAM for cached pages evicted
    # from the device (0 = off). None = auto: off on CPU (device memory is host memory),
    # else HOST_KV_CACHE_RAM_FRACTION of the machine's RAM.
    host_kv_cache_memory: int | None = None
    # Tests: fill every page that loses its content (freed or evicted) with NaN / garbage
    # before the next step, so a read of a freed page shows in the outputs.
    debug_poison_freed_pages: bool = False
    # JAX's persistent compilation cache: a later start loads the compiled steps from here
    # instead of compiling them. None or "" turns it off; the default defers to a cache
    # the process already configured (jax.config.jax_compilation_cache_dir).
    compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE
    # The model as a single-device engine runs it (fused, panelled or quantized weights),
    # saved by a first start and memory-mapped by later ones (loading/weight_cache.py).
    # None or "" turns it off.
    weight_cache_dir: str | None = DEFAULT_WEIGHT_CACHE
    seed: int = 0                            # base of per-request seeds when none is given
    # Every weight matmul batch-invariant (the f32 C++ kernel, or XLA's dot on fixed 32-row
    # tiles: jaxinfer/matmul.py): a request's tokens are the same bits alone or in any
    # batch. Cost measured in benchmarks/RESULTS.md.
    batch_invariant: bool = True
    # Devices one model is split over (0 = auto: the largest size the model's head counts
    # allow on the visible devices / data_parallel_size) and independent replicas.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Pipeline parallelism (engine/pipeline.py): the layers cut into this many stages, each
    # on its own devices (x tensor_parallel_size), a step's sequences in micro-batches that
    # flow through the stages so they overlap.
    pipeline_parallel_size: int = 1
    # Weight offload (engine/offload.py): "host" keeps the layers whose weights do not fit
    # ``device_weight_memory`` bytes (after the embedding / head and the layers before
    # them) in host memory, streamed to the device a layer ahead; "none" keeps all resident.
    offload_weights: str = "none"
    device_weight_memory: int | None = None
    # Weight-only quantization of every matmul weight at load time: None | "int8" | "int4"
    # (jaxinfer/quantization.py).
    quantization: str | None = None
    # KV pages: "int8" = int8 values + an f32 scale per token and KV head
    # (engine/kv_cache.py QuantizedPages); "model" = the model's dtype; None ("auto") = int8
    # when the weights are quantized and nothing speculates, else the model's dtype
    # (``kv_cache_dtype`` above: why).
    kv_cache_dtype: str | None = None
    # Multi-step decode (vLLM's num_scheduler_steps): when every running sequence is
    # decoding and nobody waits for admission, run up to this many decode steps in one
    # device call, feeding sampled tokens back on the device. Amortizes the host's share of
    # a step (large at batch 1: RESULTS.md); outputs stream in runs of this many tokens. Same
    # tokens as 1 (tests/test_multi_step.py). Single device, one process.
    num_scheduler_steps: int = 1
    # Speculative decoding (engine/speculative.py): None | "ngram" (prompt lookup: the
    # tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    # n from ngram_prompt_lookup_max down to ngram_prompt_lookup_min) | "self" (the target
    # model's own weights quantized to speculative_quantization, optionally only its first
    # speculative_draft_layers layers, as a draft model) | "draft" (the model at
    # speculative_model: same vocabulary, smaller; engine/spec_draft.py). Up to
    # num_speculative_tokens are verified per sequence per step; speculation pauses while
    # more than speculative_disable_by_batch_size sequences run (verifying is no longer
    # nearly free then) and for a sequence whose drafts are mostly rejected.
    speculative_method: str | None = None
    speculative_model: str | None = None
    # "self" / "draft": the draft's weight quantization (None: as loaded) and, for "self",
    # how many of the target's layers it keeps (None: all). On CPU "int4" is the C++ kernel's
    # 4-bit panels (affine per 32 rows; the LM head int8): RESULTS.md "A 4-bit draft".
    # "auto" (draft_quantization): int4 where that kernel runs or the target is quantized,
    # else int8
    speculative_quantization: str | None = "auto"
    speculative_draft_layers: int | None = None
    # 7: one sequence and its draft fill a decode bucket of 8 slots (padding slots cost
    # about as much as used ones; benchmarks/RESULTS.md compares 3, 4 and 7)
    num_speculative_tokens: int = 7
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 2
    speculative_disable_by_batch_size: int = 2
    # "ngram" only: prompt lookup proposes up to this many continuations with different
    # first tokens, all verified in the same step, and the longest accepted one is kept
    # (a token tree branching at its root, FlexFlow/SpecInfer's idea: engine/spec_tree.py).
    # 1: one chain. Each extra chain costs its rows (benchmarks/RESULTS.md: a loss on CPU)
    speculative_tree_width: int = 1
    # When the step shapes (buckets) compile (engine/warmup.py): "full" all of them before
    # the engine returns; "background" those a first request needs, the rest in a thread
    # while it serves (`jaxinfer serve`, and `Engine()`: None means it unless the process
    # chose another default, warmup.use_default_mode); "lazy" those a first request needs,
    # any other when a step first needs it (one-shot runs: `jaxinfer generate`). Once warm
    # (all compiled, never for "lazy") no step compiles.
    warmup: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs, OpenAI echo + logprobs): every
    # prefill bucket gets a scoring twin that also computes all positions' logits
    # (engine/scoring.py), compiled after the others; off, such requests are refused.
    enable_prompt_logprobs: bool = False
    # Multi-LoRA (engine/lora.py, engine/lora_device.py): PEFT adapters served beside the
    # base model, a request picking one by name. ``max_loras`` device slots of rank
    # ``max_lora_rank`` (static: the step's adapter arrays are [K, max_loras * max_lora_rank]),
    # swapped least-recently-used from up to ``max_cpu_loras`` registered adapters (None:
    # 4 x max_loras). ``lora_modules``: (name, directory) pairs loaded at start; they turn
    # LoRA on, as does ``enable_lora`` (adapters loaded later, e.g. over HTTP).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    decode_buckets: tuple[int, ...] | None = None
    mixed_decode_buckets: tuple[int, ...] | None = None
    # (slots, positions per slot): a chunk longer than a slot fills several, so one shape
    # packs several prompts into a step (engine/batch.py)
    prefill_buckets: tuple[tuple[int, int], ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # The sampler's rows are a step's sequences rounded up to a power of two, at least
    # this many. Each sampler width is an executable (~2-3 s to compile, ~26 MiB resident
    # on CPU). None: the widest any bucket needs, so one sampler serves every step (the
    # forwards write their rows into a per-width logits buffer in place, so the padding
    # costs no [rows, V] write per step: engine/runner.py forward_fn); 1: one sampler per
    # power of two. The tokens do not depend on it: rows are sampled independently.
    min_sampler_rows: int | None = None
    # The model's layers as one loop (models/layer_loop.py) where the C++ kernels allow it
    # (CPU, float32 or int8 KV pages, no LoRA / offload / pipeline stages, identical layers): each step
    # executable holds one layer instead of all of them (smaller, faster to trace and
    # compile), the same tokens; elsewhere the layers unroll. False: always unroll.
    layer_loop: bool = True
    # Float32 matmul weights whose values are exactly a block-quantized checkpoint's (a
    # GGUF's Q4_1 / Q8_0, dequantized by the loader) kept as those codes, 1.25 bytes a
    # weight instead of 4 (pallas_kernels/f32_matmul/codes.py): the CPU f32 kernel computes
    # with the very same floats, so the same bits. False: keep the floats.
    weight_codes: bool = True

    DEFAULT_KV_CACHE_MEMORY = 1 << 30
    MAX_LORA_RANK = 64
    HOST_KV_CACHE_RAM_FRACTION = 0.1

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16"), "dtype",
                 f"must be float32 or bfloat16, got {self.dtype!r}")
        _require(self.page_size in (8, 16, 32, 64, 128), "page_size",
                 f"must be one of 8, 16, 32, 64, 128, got {self.page_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "data_parallel_size", "num_scheduler_steps",
                     "pipeline_parallel_size", "min_sampler_rows"):
            v = getattr(self, name)
            if v is None and name == "min_sampler_rows":
                continue
            _require(isinstance(v, int) and v >= 1, name, f"must be a positive integer, got {v!r}")
        _require(self.quantization in (None, "int8", "int4"), "quantization",
                 f"must be None, 'int8' or 'int4', got {self.quantization!r}")
        _require(self.warmup in (None, "full", "background", "lazy"), "warmup",
                 f"must be 'full', 'background', 'lazy' or None, got {self.warmup!r}")
        _check_speculative(self)
        _check_lora(self)
        _check_pipeline(self)
        _check_offload(self)
        _require(self.kv_cache_dtype in (None, "auto", "model", "int8"), "kv_cache_dtype",
                 f"must be None / 'auto' (int8 with quantized weights unless speculating, else the "
                 f"model's dtype), "
                 f"'model' or 'int8', got {self.kv_cache_dtype!r}")
        _require(not (self.quantization and self.tensor_parallel_size > 1), "quantization",
                 "quantization with tensor_parallel_size > 1 is not supported yet (the quantized "
                 "weights' scales are not sharded)")
        v = self.tensor_parallel_size
        _require(isinstance(v, int) and v >= 0, "tensor_parallel_size",
                 f"must be a positive integer (or 0 for auto), got {v!r}")
        v = self.host_kv_cache_memory
        _require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                 "host_kv_cache_memory", f"must be a non-negative integer (bytes) or None, got {v!r}")
        for name in ("kv_cache_memory", "num_pages", "max_model_len", "max_waiting"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, int) and v >= 1), name,
                     f"must be a positive integer or None, got {v!r}")
        _require(0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction",
                 f"must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        _require(self.num_pages is None or self.num_pages >= 2, "num_pages",
                 "must be >= 2 (page 0 is the padding sink)")


SPECULATIVE_METHODS = ("ngram", "self", "draft")
# The longest draft: the sampler's per-row draft-token arrays are this wide (engine/sampler.py)
MAX_SPECULATIVE_TOKENS = 16
DRAFT_METHODS = ("self", "draft")        # those that run a draft model

# vLLM's ``speculative_config`` keys -> EngineConfig fields (speculative_fields). "draft_layers"
# and "tree_width" are ours ('self' drafting with the first layers; prompt lookup's
# candidates verified at once); "draft_tensor_parallel_size" is accepted as 1.
SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_method", "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "ngram_prompt_lookup_max", "prompt_lookup_min": "ngram_prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
    "quantization": "speculative_quantization", "draft_layers": "speculative_draft_layers",
    "tree_width": "speculative_tree_width",
}
# vLLM's method names (and ours) -> speculative_method; vLLM's trained heads (eagle, medusa,
# mtp, ...) need weights no checkpoint here carries
_SPECULATIVE_CONFIG_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "self": "self"}


def speculative_fields(spec: Any) -> dict[str, Any]:
    """vLLM's ``speculative_config`` (e.g. ``{"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_max": 4}``, or ``{"model": PATH, ...}`` for a draft model) as EngineConfig
    fields; the values are checked by EngineConfig itself. ValueError naming an unknown key,
    an unsupported method or a draft tensor-parallel size other than 1."""
    _require(isinstance(spec, Mapping), "speculative_config",
             f"expected an object of speculative settings, got {type(spec).__name__}")
    known = (*SPECULATIVE_CONFIG_KEYS, "draft_tensor_parallel_size")
    unknown = sorted(map(str, set(spec) - set(known)))
    _require(not unknown, "speculative_config", f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    _require(spec.get("draft_tensor_parallel_size") in (None, 1), "speculative_config.draft_tensor_parallel_size",
             f"the draft runs on one device: must be 1, got {spec.get('draft_tensor_parallel_size')!r}")
    method = spec.get("method") or ("draft_model" if spec.get("model") is not None else None)
    _require(method in _SPECULATIVE_CONFIG_METHODS, "speculative_config.method",
             f"must be one of {', '.join(map(repr, _SPECULATIVE_CONFIG_METHODS))} (or give 'model' for a "
             f"draft model), got {method!r}: methods that need trained draft heads (eagle, medusa, "
             "mtp) are not supported")
    out = {SPECULATIVE_CONFIG_KEYS[k]: v for k, v in spec.items() if k in SPECULATIVE_CONFIG_KEYS}
    out["speculative_method"] = _SPECULATIVE_CONFIG_METHODS[method]
    return out


def with_speculative_config(options: Mapping[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments with ``speculative_config`` (vLLM's dict) replaced by
    the fields it sets; ValueError where a field is also given on its own (which one wins
    would be a guess)."""
    out = dict(options)
    spec = out.pop("speculative_config")
    if spec is None:
        return out
    fields = speculative_fields(spec)
    both = sorted(set(fields) & {k for k, v in out.items() if v is not None})
    _require(not both, "speculative_config", f"also given on its own: {', '.join(both)}; give each setting once")
    return {**out, **fields}


def _check_offload(c: "EngineConfig") -> None:
    _require(c.offload_weights in ("none", "host"), "offload_weights",
             f"must be 'none' or 'host', got {c.offload_weights!r}")
    v = c.device_weight_memory
    _require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "device_weight_memory",
             f"must be a positive number of bytes or None, got {v!r}")
    if c.offload_weights == "none":
        return
    _require(v is not None, "device_weight_memory", "offload_weights='host' needs the device budget in bytes")
    for name, bad in (("tensor_parallel_size", c.tensor_parallel_size != 1),
                      ("pipeline_parallel_size", c.pipeline_parallel_size > 1), ("enable_lora", c.enable_lora)):
        _require(not bad, name, "cannot be combined with offload_weights='host' yet (one device per replica, "
                 "no LoRA)")


def _check_pipeline(c: "EngineConfig") -> None:
    """Options a pipelined engine cannot run yet (the model-dependent checks, e.g. that the
    stages divide the layers, are engine/pipeline.py's)."""
    if c.pipeline_parallel_size == 1:
        return
    for name, bad, why in (
            ("num_scheduler_steps", c.num_scheduler_steps > 1, "multi-step decode runs on one device"),
            ("enable_lora", c.enable_lora, "LoRA slot arrays are not split into stages yet"),
            ("host_kv_cache_memory", bool(c.host_kv_cache_memory), "the host KV tier copies whole-model pages"),
            ("debug_poison_freed_pages", c.debug_poison_freed_pages, "page poisoning copies whole-model pages"),
            ("quantization", c.quantization is not None, "quantized weights are not split into stages yet")):
        _require(not bad, name, f"cannot be combined with pipeline_parallel_size={c.pipeline_parallel_size} ({why})")


def _check_lora(c: "EngineConfig") -> None:
    """(Adapter names and files are checked when the engine loads them: engine/lora.py.)"""
    mods = c.lora_modules.items() if isinstance(c.lora_modules, dict) else c.lora_modules
    try:
        mods = tuple((n, p) for n, p in mods)
    except (TypeError, ValueError):
        raise ValueError(f"lora_modules: expected (name, path) pairs, got {c.lora_modules!r:.80}") from None
    _require(all(isinstance(x, str) and x for m in mods for x in m), "lora_modules",
             "names and paths must be non-empty strings")
    _require(len({n for n, _ in mods}) == len(mods), "lora_modules", "a name appears twice")
    object.__setattr__(c, "lora_modules", mods)
    if mods:
        object.__setattr__(c, "enable_lora", True)
    _require(isinstance(c.max_loras, int) and not isinstance(c.max_loras, bool) and 1 <= c.max_loras <= 256,
             "max_loras", f"must be an integer in [1, 256], got {c.max_loras!r}")
    _require(isinstance(c.max_lora_rank, int) and not isinstance(c.max_lora_rank, bool)
             and 1 <= c.max_lora_rank <= c.MAX_LORA_RANK, "max_lora_rank",
             f"must be an integer in [1, {c.MAX_LORA_RANK}], got {c.max_lora_rank!r}")
    if c.max_cpu_loras is None:
        object.__setattr__(c, "max_cpu_loras", 4 * c.max_loras)
    _require(isinstance(c.max_cpu_loras, int) and c.max_cpu_loras >= max(c.max_loras, len(mods)),
             "max_cpu_loras", f"must be an integer >= max_loras ({c.max_loras}) and the number of "
             f"lora_modules ({len(mods)}), got {c.max_cpu_loras!r}")


def _check_speculative(c: "EngineConfig") -> None:
    m = c.speculative_method
    _require(m in (None, *SPECULATIVE_METHODS), "speculative_method",
             f"must be None or one of {', '.join(map(repr, SPECULATIVE_METHODS))}, got {m!r}")
    for name in ("num_speculative_tokens", "ngram_prompt_lookup_max", "ngram_prompt_lookup_min",
                 "speculative_disable_by_batch_size", "speculative_tree_width"):
        v = getattr(c, name)
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
                 f"must be a positive integer, got {v!r}")
    _require(c.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
             f"must be <= {MAX_SPECULATIVE_TOKENS}, got {c.num_speculative_tokens}")
    _require(c.speculative_tree_width <= 4, "speculative_tree_width", f"must be <= 4, got {c.speculative_tree_width}")
    _require(c.speculative_tree_width == 1 or m == "ngram", "speculative_tree_width",
             f"candidates come from prompt lookup: > 1 needs speculative_method='ngram' (got {m!r})")
    _require(c.ngram_prompt_lookup_min <= c.ngram_prompt_lookup_max, "ngram_prompt_lookup_min",
             f"must be <= ngram_prompt_lookup_max ({c.ngram_prompt_lookup_max}), got {c.ngram_prompt_lookup_min}")
    _require(c.speculative_quantization in (None, "auto", "int8", "int4"), "speculative_quantization",
             f"must be None, 'auto', 'int8' or 'int4', got {c.speculative_quantization!r}")
    v = c.speculative_draft_layers
    _require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "speculative_draft_layers",
             f"must be a positive integer or None, got {v!r}")
    _require(v is None or m == "self", "speculative_draft_layers",
             f"only applies to speculative_method='self' (got {m!r})")
    _require((c.speculative_model is not None) == (m == "draft"), "speculative_model",
             "is required by speculative_method='draft' (a model with the target's vocabulary) and "
             f"only used by it (speculative_method={m!r})")
    if m == "self":
        q = draft_quantization(c, int4_kernel=False)    # "auto" is the same draft either way here
        _require(v is not None or q not in (None, c.quantization), "speculative_method",
                 f"'self' with speculative_quantization={q!r} and all layers would draft "
                 f"with the target itself (quantization={c.quantization!r}): choose a cheaper draft "
                 "(speculative_quantization int8 for a float target; int4 for an int8 one) "
                 "or speculative_draft_layers, or speculative_method='ngram'")
    if m in DRAFT_METHODS:
        _require(c.tensor_parallel_size == 1, "speculative_method",
                 f"{m!r} runs its draft model on one device: tensor_parallel_size must be 1")
    if m is not None:
        _require(c.num_scheduler_steps == 1, "speculative_method",
                 "speculative decoding with num_scheduler_steps > 1 is not supported")
        _require(c.data_parallel_size == 1, "speculative_method",
                 "speculative decoding with data_parallel_size > 1 is not supported")

"""Pre-quantized HF checkpoints (compressed-tensors, GPTQ, AWQ, FP8, bitsandbytes, ...) are
refused before any weight is read, naming their format and scheme.

Why: the loaders read every checkpoint tensor as a float weight. A W8A8 checkpoint's int8
codes would be taken for the weights, its scales ignored: no error, wrong tokens. A packed
one (W4A16) would fail naming a "missing" weight, which says nothing about the cause.
jaxinfer quantizes float checkpoints itself (EngineConfig.quantization); GGUF's own quant
types are dequantized by loading/gguf.py and are not concerned here.

Two checks: ``refuse_quantization_config`` (config.json declares the format; called by
registry.config_from_hf, which every loader goes through) and ``refuse_quantized_tensors``
(a checkpoint that declares nothing but holds tensors only quantized formats write; called
with the names of the safetensors headers, before any tensor is read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# config.json keys that declare a quantized checkpoint: transformers' quantization_config,
# and compression_config, the key older compressed-tensors (sparseml) checkpoints use.
CONFIG_KEYS = ("quantization_config", "compression_config")

# The last dotted part of tensor names only quantized formats write -> which formats. Left
# out on purpose: GPTQ/AWQ's `scales` (too generic a name alone; their `qweight` is caught)
# and Marlin's one-letter `B` / `s`. No supported family's checkpoint uses any of these
# (tests/test_quantized_refusal.py checks every family's tensor names).
QUANTIZED_TENSOR_SUFFIXES = {
    "weight_scale": "compressed-tensors / FP8",
    "weight_scale_inv": "FP8 block-quantized",
    "weight_zero_point": "compressed-tensors",
    "weight_packed": "compressed-tensors pack-quantized",
    "weight_shape": "compressed-tensors pack-quantized",
    "weight_g_idx": "compressed-tensors",
    "weight_global_scale": "compressed-tensors NVFP4",
    "input_scale": "compressed-tensors / FP8 static activations",
    "input_zero_point": "compressed-tensors",
    "output_scale": "compressed-tensors",
    "k_scale": "quantized KV cache",
    "v_scale": "quantized KV cache",
    "qweight": "GPTQ / AWQ",
    "qzeros": "GPTQ / AWQ",
    "g_idx": "GPTQ",
    "SCB": "bitsandbytes int8",
    "absmax": "bitsandbytes 4-bit",
    "quant_map": "bitsandbytes 4-bit",
    "nested_absmax": "bitsandbytes 4-bit",
    "nested_quant_map": "bitsandbytes 4-bit",
    "weight_scales": "EETQ",
    "codebooks": "AQLM",
    "W_q": "HQQ",
    "_data": "quanto",
    "_scale": "quanto",
}
# bitsandbytes 4-bit also writes `<name>.weight.quant_state.bitsandbytes__nf4` (or __fp4)
BNB_QUANT_STATE = ".quant_state."

NOT_SUPPORTED = ("pre-quantized checkpoints are not supported yet; load the unquantized (float) "
                 "checkpoint instead (--quantization int8 or int4 quantizes it at load)")
MAX_TEXT = 40        # longest config value echoed in a message (the config is the user's file)


def refuse_quantization_config(hf_config: Mapping[str, Any]) -> None:
    """ValueError naming the format, its scheme and the field when ``hf_config`` (a
    config.json dict) declares a quantized checkpoint: no such format is implemented."""
    for key in CONFIG_KEYS:
        block = hf_config.get(key)
        if block is None or block == {}:     # declares nothing
            continue
        if not isinstance(block, Mapping):
            raise ValueError(f"{key}: must be an object naming the quant_method, got a "
                             f"{type(block).__name__}: {NOT_SUPPORTED}")
        block = _flattened(block)
        method = block.get("quant_method")
        scheme = describe_scheme(block)
        what = (f"{_text(method)!r} checkpoint" if method is not None
                else f"missing, but {key} declares a quantized checkpoint")
        raise ValueError(f"{key}.quant_method: {what}{f', {scheme}' if scheme else ''}: {NOT_SUPPORTED}")


def refuse_quantized_tensors(names: Iterable[str]) -> None:
    """ValueError naming the first (sorted) tensor of ``names`` that only quantized formats
    write: for a checkpoint whose config.json does not say it is quantized."""
    for name in sorted(names):
        fmt = quantized_tensor_format(name)
        if fmt is not None:
            raise ValueError(f"tensor {name!r} is a {fmt} quantized checkpoint's tensor, but config.json "
                             f"declares no quantization_config: {NOT_SUPPORTED}")


def quantized_tensor_format(name: str) -> str | None:
    """Which quantized formats write a tensor named ``name``; None for a float checkpoint's."""
    if BNB_QUANT_STATE in name:
        return "bitsandbytes 4-bit"
    return QUANTIZED_TENSOR_SUFFIXES.get(name.rsplit(".", 1)[-1])


def describe_scheme(block: Mapping[str, Any]) -> str:
    """The scheme ``block`` (a quantization_config) declares, in words:
    "int-quantized W8A8 [weights int8 per channel, input activations int8 per token dynamic]",
    "4-bit group 128"; "" when it says nothing recognisable."""
    if block.get("quant_method") in ("compressed-tensors", "sparseml") or "config_groups" in block:
        return _compressed_tensors_scheme(block)
    parts = []
    bits = _first(block, "bits", "w_bit", "num_bits")
    if bits is not None:
        parts.append(f"{_text(bits)}-bit")
    if block.get("load_in_4bit"):
        parts.append(f"4-bit {_text(block.get('bnb_4bit_quant_type') or '')}".strip())
    elif block.get("load_in_8bit"):
        parts.append("8-bit")
    group = _first(block, "group_size", "q_group_size")
    if group is not None:
        parts.append(f"group {_text(group)}")
    if block.get("weight_block_size") is not None:
        parts.append(f"weight blocks {_text(block['weight_block_size'])}")
    if block.get("activation_scheme") is not None:
        parts.append(f"{_text(block['activation_scheme'])} activations")
    return " ".join(parts)


def _compressed_tensors_scheme(block: Mapping[str, Any]) -> str:
    """compressed-tensors: each config group's "<format> W<bits>A<bits> [group <n>]" with its
    weights' and input activations' type, bits and strategy; the KV cache and sparsity."""
    groups = block.get("config_groups")
    schemes = [_group_scheme(g, block.get("format")) for g in groups.values()] \
        if isinstance(groups, Mapping) else []
    kv = block.get("kv_cache_scheme")
    if isinstance(kv, Mapping):
        schemes.append(f"KV cache {_args_text(kv)}")
    sparsity = block.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity:
        schemes.append(f"sparsity {_text(sparsity.get('format') or 'declared')}")
    return "; ".join(s for s in schemes if s) or _text(block.get("format") or "")


def _group_scheme(group: Any, default_format: Any) -> str:
    if not isinstance(group, Mapping):
        return ""
    w, a = group.get("weights"), group.get("input_activations")
    w = w if isinstance(w, Mapping) else {}
    a = a if isinstance(a, Mapping) else {}
    fmt = group.get("format") or default_format
    name = f"W{_text(w.get('num_bits', '?'))}A{_text(a.get('num_bits', 16))}"
    head = " ".join(p for p in (_text(fmt) if fmt else "", name,
                                f"group {_text(w['group_size'])}" if w.get("group_size") else "") if p)
    details = [f"weights {_args_text(w)}"] if w else []
    if a:
        details.append(f"input activations {_args_text(a)}")
    return f"{head} [{', '.join(details)}]" if details else head


def _args_text(args: Mapping[str, Any]) -> str:
    """A compressed-tensors QuantizationArgs dict: "int8 per channel", "int8 per token dynamic"."""
    dtype = f"{_text(args.get('type', ''))}{_text(args.get('num_bits', ''))}"
    strategy = args.get("strategy")
    return " ".join(p for p in (dtype, f"per {_text(strategy)}" if strategy else "",
                                "dynamic" if args.get("dynamic") is True else "") if p)


def _flattened(block: Mapping[str, Any]) -> Mapping[str, Any]:
    """``block`` as one dict: older compressed-tensors configs nest the quantization part
    (``{"quantization_config": {...}, "sparsity_config": {...}}``), as transformers reads them."""
    inner = block.get("quantization_config")
    if "quant_method" not in block and isinstance(inner, Mapping):
        return {**block, **inner}
    return block


def _first(block: Mapping[str, Any], *keys: str) -> Any:
    return next((block[k] for k in keys if block.get(k) is not None), None)


def _text(v: Any) -> str:
    s = v if isinstance(v, str) else str(v)
    return s if len(s) <= MAX_TEXT else s[:MAX_TEXT] + "..."

"""GGUF files of the GPT-style architectures llama.cpp writes: gpt2, gptneox, bloom,
falcon, starcoder (GPTBigCode) and mpt -> an HF-style config dict and HF-named tensors in
HF's layout, which models/gpt.py's weight table then reads like any HF checkpoint.

What llama.cpp's converter (convert_hf_to_gguf.py) changes, undone here:
* GPT-2's Conv1D weights ([in, out]) were transposed to [out, in];
* the fused q/k/v rows were regrouped to [all q; all k; all v]: GPT-NeoX and BLOOM keep
  them per head (q, k, v of head 0, then head 1, ..), Falcon per KV group (the group's
  query heads, then its k and v);
* the config lives in ``<arch>.*`` metadata keys; what the format does not store (the
  activation, Falcon's parallel attention) is each family's fixed choice in llama.cpp, as
  in the HF models it converts.
Tensor names are the ``gguf`` package's own table (``gguf.get_tensor_name_map``), inverted
for the names models/gpt.py reads.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

# GGUF `general.architecture` -> HF `architectures[0]` / `model_type`.
ARCHS = {
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "gptneox": ("GPTNeoXForCausalLM", "gpt_neox"),
    "bloom": ("BloomForCausalLM", "bloom"),
    "falcon": ("FalconForCausalLM", "falcon"),
    "starcoder": ("GPTBigCodeForCausalLM", "gpt_bigcode"),
    "mpt": ("MptForCausalLM", "mpt"),
}


def config(path: str, arch: str, meta: dict, infos: dict) -> dict[str, Any]:
    """The HF config.json a GGUF of ``arch`` was converted from (the fields the family's
    reader in models/gpt_config.py needs)."""
    hf_arch, model_type = ARCHS[arch]

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ValueError(f"{path}: metadata key {arch}.{name} is missing")
        return v

    D, H, L = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    kvh = int(key("attention.head_count_kv", H))
    ffn = int(key("feed_forward_length", 4 * D))
    ctx = int(key("context_length", 2048))
    eps = float(key("attention.layer_norm_epsilon", 1e-5))
    bias = "blk.0.attn_qkv.bias" in infos
    emb = infos.get("token_embd.weight")
    c: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(emb.shape[1]) if emb is not None else None,
        "tie_word_embeddings": "output.weight" not in infos,
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
    }
    if arch in ("gpt2", "starcoder"):
        c.update(n_embd=D, n_head=H, n_layer=L, n_positions=ctx, n_inner=ffn, layer_norm_epsilon=eps)
        if arch == "starcoder":
            c["multi_query"] = kvh == 1
    elif arch == "gptneox":
        rot = int(key("rope.dimension_count", D // H))
        c.update(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, intermediate_size=ffn,
                 max_position_embeddings=ctx, layer_norm_eps=eps, rotary_pct=rot / (D // H),
                 rotary_emb_base=float(key("rope.freq_base", 10000.0)),
                 use_parallel_residual=bool(key("use_parallel_residual", True)), attention_bias=bias)
    elif arch == "bloom":
        c.update(hidden_size=D, n_head=H, n_layer=L, seq_length=ctx, layer_norm_epsilon=eps)
    elif arch == "falcon":
        two_norms = "blk.0.attn_norm_2.weight" in infos
        c.update(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, num_kv_heads=kvh,
                 multi_query=kvh == 1, new_decoder_architecture=two_norms or kvh not in (1, H),
                 num_ln_in_parallel_attn=2 if two_norms else 1, parallel_attn=True, bias=bias,
                 ffn_hidden_size=ffn, max_position_embeddings=ctx, layer_norm_epsilon=eps,
                 rope_theta=float(key("rope.freq_base", 10000.0)))
    else:  # mpt
        if kvh != H:
            raise ValueError(f"{path}: mpt.attention.head_count_kv {kvh} != head_count {H}: "
                             "grouped-query MPT is not supported")
        clip = meta.get("mpt.attention.clamp_kqv")
        c.update(d_model=D, n_heads=H, n_layers=L, max_seq_len=ctx, ffn_hidden_size=ffn,
                 layer_norm_epsilon=eps, no_bias=True,
                 attn_config={"alibi": float(key("attention.max_alibi_bias", 0.0)) > 0,
                              "alibi_bias_max": float(key("attention.max_alibi_bias", 0.0)),
                              "clip_qkv": None if clip is None else float(clip)})
    return c


def hf_names(path: str, arch: str, cfg: dict, names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> the HF name models/gpt.py's weight table reads."""
    from jaxinfer.models.registry import config_from_hf, weight_specs

    mc = config_from_hf(cfg)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_ARCH_ENUM[arch]], mc.num_layers)
    want: dict[str, str] = {}
    for spec in weight_specs(mc).values():
        # the table knows some names only without the model prefix (BLOOM's converter
        # strips it first): the spec's other name (hf_alt) is tried after its own
        for hf in (spec.hf_name, spec.hf_alt):
            base, _, kind = (hf or "").rpartition(".")
            g = tmap.get_name(base) if hf else None
            if g is not None:
                want.setdefault(f"{g}.{kind}", hf)
                break
    out = {}
    for name in names:
        if name not in want:
            raise ValueError(f"{path}: unexpected tensor {name!r} (not part of a {arch} decoder "
                             "jaxinfer reads)")
        out[name] = want[name]
    return out


def to_hf_layout(arch: str, cfg: dict, name: str, w: np.ndarray) -> np.ndarray:
    """Undo the converter's change to tensor ``name`` (its GGUF name)."""
    if arch == "gpt2" and w.ndim == 2 and name.split(".")[-2] in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
        return np.ascontiguousarray(w.T)                  # back to Conv1D's [in, out]
    if ".attn_qkv." not in name or arch not in ("gptneox", "bloom", "falcon"):
        return w
    H = cfg.get("num_attention_heads", cfg.get("n_head"))
    hd = w.shape[0] // (3 * H) if arch != "falcon" else cfg["hidden_size"] // H
    kvh = cfg.get("num_kv_heads", H) if arch == "falcon" else H
    rest = w.shape[1:]
    q, k, v = np.split(w, [H * hd, (H + kvh) * hd], axis=0)
    groups = [q.reshape(kvh, H // kvh, hd, *rest), k.reshape(kvh, 1, hd, *rest), v.reshape(kvh, 1, hd, *rest)]
    return np.concatenate(groups, axis=1).reshape(w.shape)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


# GGUF architecture name -> gguf.MODEL_ARCH member name
_ARCH_ENUM = {"gpt2": "GPT2", "gptneox": "GPTNEOX", "bloom": "BLOOM", "falcon": "FALCON",
              "starcoder": "STARCODER", "mpt": "MPT"}

"""GGUF files of the GPT-style families (loading/gguf_gpt.py): gpt2, gptneox, bloom,
falcon, starcoder and mpt, written from the tiny HF models of tests/test_gpt_families.py
the way llama.cpp's convert_hf_to_gguf.py writes them (its metadata keys, the ``gguf``
package's tensor names, its transposes and q/k/v regrouping), read by ``load_model``:
logits within 1e-4 of transformers' on the original weights.

The writer here is a test-side copy of the converter's rules, so for GPT-2 and BLOOM the
file is also read by transformers' own GGUF loader, which must give the original model's
logits: the rules the writer follows are the ones transformers undoes too, not ours alone.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips
import gguf  # a declared dependency (test extras): missing it fails, never skips

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from test_gpt_families import CASES, PROMPTS, TAIL, hf_checkpoint, rel_err  # noqa: E402

GGUF_ARCH = {"GPT2LMHeadModel": "gpt2", "GPTNeoXForCausalLM": "gptneox", "BloomForCausalLM": "bloom",
             "FalconForCausalLM": "falcon", "GPTBigCodeForCausalLM": "starcoder", "MptForCausalLM": "mpt"}
# every family llama.cpp converts (OPT it does not), MQA and grouped Falcon
GGUF_CASES = ["gpt2", "gpt_neox", "bloom", "falcon", "falcon-7b-style-mqa", "gpt_bigcode", "mpt"]


def _metadata(arch: str, c: dict, n_layer: int) -> dict[str, int | float | str]:
    """What the converter's set_gguf_parameters writes for ``arch`` (c: config.json)."""
    if arch in ("gpt2", "starcoder"):
        m = {"context_length": c["n_positions"], "embedding_length": c["n_embd"],
             "feed_forward_length": 4 * c["n_embd"], "attention.head_count": c["n_head"],
             "attention.layer_norm_epsilon": c["layer_norm_epsilon"]}
        if arch == "starcoder":
            m["attention.head_count_kv"] = 1
    elif arch == "gptneox":
        H, D = c["num_attention_heads"], c["hidden_size"]
        pct = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("rotary_pct"))
        m = {"context_length": c["max_position_embeddings"], "embedding_length": D,
             "feed_forward_length": c["intermediate_size"], "rope.dimension_count": int(pct * (D // H)),
             "attention.head_count": H, "use_parallel_residual": c.get("use_parallel_residual", True),
             "attention.layer_norm_epsilon": c["layer_norm_eps"]}
    elif arch == "bloom":
        m = {"context_length": c.get("seq_length", c["hidden_size"]), "embedding_length": c["hidden_size"],
             "feed_forward_length": 4 * c["hidden_size"], "attention.head_count": c["n_head"],
             "attention.head_count_kv": c["n_head"], "attention.layer_norm_epsilon": c["layer_norm_epsilon"]}
    elif arch == "falcon":
        m = {"context_length": 2048, "embedding_length": c["hidden_size"],
             "feed_forward_length": 4 * c["hidden_size"], "attention.head_count": c["num_attention_heads"],
             "attention.head_count_kv": _falcon_kv(c), "attention.layer_norm_epsilon": c["layer_norm_epsilon"]}
    else:
        ac = c["attn_config"]
        m = {"context_length": c["max_seq_len"], "embedding_length": c["d_model"],
             "feed_forward_length": 4 * c["d_model"], "attention.head_count": c["n_heads"],
             "attention.layer_norm_epsilon": 1e-5, "attention.max_alibi_bias": float(ac["alibi_bias_max"])}
        if ac.get("clip_qkv") is not None:
            m["attention.clamp_kqv"] = float(ac["clip_qkv"])
    return {"block_count": n_layer, **m}


def _falcon_kv(c: dict) -> int:
    """The converter's n_head_kv: num_kv_heads of a new-architecture config; a Falcon-7B
    config (multi-query, no num_kv_heads field) gets 1."""
    return c["num_kv_heads"] if c.get("new_decoder_architecture") else (1 if c.get("multi_query", True) else
                                                                         c["num_attention_heads"])


def _regroup_qkv(arch: str, c: dict, t: np.ndarray) -> np.ndarray:
    """The converter's q/k/v regrouping: per head (NeoX, BLOOM) or per KV group (Falcon)
    -> [all q; all k; all v]."""
    H = c.get("num_attention_heads", c.get("n_head"))
    kv = _falcon_kv(c) if arch == "falcon" else H
    hd = c["hidden_size"] // H
    g = t.reshape(kv, -1, hd, *t.shape[1:])                       # [kv, q_per_kv + 2, hd, ...]
    q, k, v = g[:, :-2], g[:, -2:-1], g[:, -1:]
    return np.concatenate([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)])


def write_like_llama_cpp(ckpt_dir: str, out: pathlib.Path) -> None:
    import json

    from safetensors.numpy import load_file

    from test_gguf import _byte_tokens, add_metadata

    c = json.loads((pathlib.Path(ckpt_dir) / "config.json").read_text())
    arch = GGUF_ARCH[c["architectures"][0]]
    tensors = load_file(str(pathlib.Path(ckpt_dir) / "model.safetensors"))
    n_layer = next(c[k] for k in ("n_layer", "num_hidden_layers", "n_layers") if k in c)
    w = gguf.GGUFWriter(str(out), arch)
    add_metadata(w, {f"{arch}.{k}": v for k, v in _metadata(arch, c, n_layer).items()})
    toks = _byte_tokens()[2:258]                      # the 256 byte symbols: token id = byte
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * len(toks))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"gpt2": "GPT2", "gptneox": "GPTNEOX", "bloom": "BLOOM",
                                                     "falcon": "FALCON", "starcoder": "STARCODER",
                                                     "mpt": "MPT"}[arch]], n_layer)
    for name, t in tensors.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if arch == "bloom":
            name = name.replace("transformer.", "")
        if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = t.T
        if arch in ("gptneox", "bloom", "falcon") and "query_key_value" in name:
            t = _regroup_qkv(arch, c, t)
        base, kind = name.rsplit(".", 1)
        g = tmap.get_name(base)
        assert g is not None, f"{arch}: no GGUF name for {name}"
        w.add_tensor(f"{g}.{kind}", np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_gpt")


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_logits_match_hf(case, root):
    from jaxinfer.loading import load_model
    from jaxinfer.quality import tail_logits

    ckpt, hf = hf_checkpoint(case, root)
    path = root / f"{case}.gguf"
    write_like_llama_cpp(ckpt, path)
    loaded = load_model(str(path))
    assert loaded.config.architecture == CASES[case][0] and loaded.config.gpt is not None
    for ids in PROMPTS[1:]:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -TAIL:].numpy()
        err = rel_err(tail_logits(loaded.model, ids, TAIL), want)
        assert err < 1e-4, f"{case} GGUF: prompt of {len(ids)} tokens, relative logit error {err:.2e}"


@pytest.mark.parametrize("case", ["gpt2", "bloom"])
def test_writer_follows_what_transformers_reads(case, root):
    """transformers' own GGUF loader reads the test's file back to the original model."""
    ckpt, hf = hf_checkpoint(case, root)
    path = root / f"{case}-tf.gguf"
    write_like_llama_cpp(ckpt, path)
    # (transformers' GPT-2 reader takes context_length as n_ctx only: n_positions given here)
    extra = {"n_positions": hf.config.n_positions} if case == "gpt2" else {}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name,
                                                               dtype=torch.float32, **extra).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        err = rel_err(theirs(ids).logits[0].numpy(), hf(ids).logits[0].numpy())
    assert err < 1e-5, f"{case}: transformers reads the test's GGUF differently ({err:.2e})"

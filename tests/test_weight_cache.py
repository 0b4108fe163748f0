"""The weight cache (loading/weight_cache.py, loading/prepared.py): a first load prepares
the weights in place and saves them, a second maps them; both give the same model,
tokenizer and configs. A changed source, other kernels or a damaged entry are not served."""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.loading import prepared, weight_cache
from jaxinfer.loading.prepared import load_prepared
from test_gguf import tiny_hf_weights, write_gguf


@pytest.fixture()
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_weights())
    return str(path)


def _state(model) -> dict:
    """path -> (container type, its arrays as numpy)."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            out[path] = (type(value).__name__, [np.asarray(x) for x in jax.tree.leaves(value)])
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_as_read_equals_quantized_after_the_load(gguf_path, quantization, monkeypatch):
    """load_prepared quantizes each matmul weight as the loader reads it
    (quantization.weight_finisher: the float32 model is never whole in memory): the same
    containers and bits as loading the float32 model and quantizing it afterwards."""
    from jaxinfer.loading import load_model
    from jaxinfer.quantization import prepare_for_engine

    finishers = []
    real = prepared.load_model
    monkeypatch.setattr(prepared, "load_model", lambda *a, **k: finishers.append(k.get("finish")) or real(*a, **k))
    as_read = _state(load_prepared(gguf_path, "float32", quantization, "").model)
    assert len(finishers) == 1 and finishers[0] is not None          # quantized as read
    after = _state(prepare_for_engine(load_model(gguf_path, "float32").model, quantization, in_place=True))
    assert as_read.keys() == after.keys()
    assert any(kind == "QuantizedWeight" for kind, _ in as_read.values())
    for path in after:
        assert as_read[path][0] == after[path][0], path
        for x, y in zip(as_read[path][1], after[path][1], strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            np.testing.assert_array_equal(x, y, err_msg=str(path))


def _loads_from_source(monkeypatch) -> list[str]:
    calls = []
    real = prepared.load_model
    monkeypatch.setattr(prepared, "load_model", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_second_load_maps_the_first_ones_weights(gguf_path, tmp_path, monkeypatch, quantization):
    cache = str(tmp_path / "cache")
    calls = _loads_from_source(monkeypatch)
    first = load_prepared(gguf_path, "float32", quantization, cache)
    second = load_prepared(gguf_path, "float32", quantization, cache)
    assert calls == [gguf_path]                          # the second came from the cache
    a, b = _state(first.model), _state(second.model)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path][0] == b[path][0], path
        for x, y in zip(a[path][1], b[path][1], strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            np.testing.assert_array_equal(x, y, err_msg=str(path))
    if quantization is None:   # the tied head is stored once and read back as one array
        assert a[("embed",)][0] == "TiedEmbedding"
        head = second.model.lm_head.get_value()
        assert second.model.embed.get_value().head.unsafe_buffer_pointer() == head.unsafe_buffer_pointer()
        tokens = jnp.arange(0, 260, 7, dtype=jnp.int32)
        table = tiny_hf_weights()["model.embed_tokens.weight"]
        np.testing.assert_array_equal(np.asarray(second.model.embed.get_value().rows(tokens)),
                                      table[np.asarray(tokens)])
    assert (second.config, second.hf_config, second.generation_config, second.source) == \
        (first.config, first.hf_config, first.generation_config, first.source)
    t1, t2 = first.tokenizer, second.tokenizer
    assert (t2.eos_token_ids, t2.vocab_size, t2.bos_token_id) == (t1.eos_token_ids, t1.vocab_size, t1.bos_token_id)
    for text in ("hello", "hell hello\n", "<s>he</s>"):
        assert t2.encode(text) == t1.encode(text)
        assert t2.decode(t1.encode(text)) == t1.decode(t1.encode(text))


def test_weights_are_mapped_not_copied(gguf_path, tmp_path):
    cache = str(tmp_path / "cache")
    load_prepared(gguf_path, "float32", None, cache)
    second = load_prepared(gguf_path, "float32", None, cache)
    entry = next(p for p in (tmp_path / "cache").iterdir())
    norm = second.model.final_norm.get_value()
    mapped = np.load(entry / next(w["arrays"][""]["file"] for w in
                                  json.loads((entry / weight_cache.META).read_text())["weights"]
                                  if w["path"] == ["final_norm"]), mmap_mode="r")
    np.testing.assert_array_equal(np.asarray(norm), mapped)
    # the jax array is the file's mapping itself: its pages lie in the .npy file
    maps = [line.split() for line in open("/proc/self/maps")]
    ptr = norm.unsafe_buffer_pointer()
    assert any(int(a, 16) <= ptr < int(b, 16) and m[-1].startswith(str(entry))
               for m in maps if len(m) >= 6 for a, b in [m[0].split("-")])


def test_a_changed_source_other_options_or_kernels_are_not_served(gguf_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    calls = _loads_from_source(monkeypatch)
    load_prepared(gguf_path, "float32", None, str(cache))
    old = set(cache.iterdir())
    load_prepared(gguf_path, "float32", "int8", str(cache))           # other options: another entry
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2
    st = os.stat(gguf_path)
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # the file changed
    load_prepared(gguf_path, "float32", None, str(cache))
    assert len(calls) == 3
    # the new float32 entry replaced the old one; the int8 entry stays
    assert len(list(cache.iterdir())) == 2 and not old & set(cache.iterdir())
    monkeypatch.setattr(prepared, "kernel_layout", lambda q, d: {"f32_kernel": "elsewhere"})
    load_prepared(gguf_path, "float32", None, str(cache))              # laid out for other kernels
    assert len(calls) == 4


def test_a_damaged_entry_is_reloaded_from_the_source(gguf_path, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    calls = _loads_from_source(monkeypatch)
    load_prepared(gguf_path, "float32", None, str(cache))
    entry = next(cache.iterdir())
    next(entry.glob("*.npy")).unlink()
    with caplog.at_level(logging.WARNING, logger="jaxinfer"):
        again = load_prepared(gguf_path, "float32", None, str(cache))
    assert len(calls) == 2 and "unreadable" in caplog.text
    assert again.model.lm_head.get_value().shape == (64, 260)


def test_off_when_no_directory(gguf_path, tmp_path, monkeypatch):
    calls = _loads_from_source(monkeypatch)
    for off in (None, ""):
        load_prepared(gguf_path, "float32", None, off)
    assert len(calls) == 2


def test_cache_directory_others_can_write_is_refused(gguf_path, tmp_path, caplog):
    cache = tmp_path / "open_to_all"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    with caplog.at_level(logging.WARNING, logger="jaxinfer"):
        load_prepared(gguf_path, "float32", None, str(cache))
    assert "not saved" in caplog.text and not list(cache.iterdir())


def test_default_dir_from_the_environment(monkeypatch, tmp_path):
    """EngineConfig's default weight cache: the process's choice (use_default_dir), else
    $JAXINFER_WEIGHT_CACHE (how tests hand theirs to the processes they start), else ~."""
    from jaxinfer.engine_config import DEFAULT_WEIGHT_CACHE
    from jaxinfer.loading import weight_cache as W

    monkeypatch.setattr(W, "_default_dir", None)
    monkeypatch.setenv("JAXINFER_WEIGHT_CACHE", str(tmp_path / "env"))
    assert W.resolve_dir(DEFAULT_WEIGHT_CACHE) == str(tmp_path / "env")
    assert W.resolve_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert W.resolve_dir(None) is None and W.resolve_dir("") is None
    monkeypatch.delenv("JAXINFER_WEIGHT_CACHE")
    assert W.resolve_dir(DEFAULT_WEIGHT_CACHE) == os.path.expanduser(DEFAULT_WEIGHT_CACHE)
    monkeypatch.setattr(W, "_default_dir", str(tmp_path / "chosen"))
    assert W.resolve_dir(DEFAULT_WEIGHT_CACHE) == str(tmp_path / "chosen")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_block_quantized_weights_are_kept_as_codes(tmp_path, monkeypatch, qtype):
    """A GGUF's Q8_0 / Q4_1 matrices, dequantized to float32 by the loader, are prepared as
    their exact codes (CodedF32, pallas_kernels/f32_matmul/codes.py): saved, mapped back by
    the second load, and the model's logits are bitwise those of the same model prepared
    as float32 panels (``codes=False``, a cache entry of its own)."""
    import gguf

    from jaxinfer.reference import ReferenceGenerator
    from pallas_kernels.f32_matmul.cpu import CodedF32, PanelledF32, available

    assert available()
    path = tmp_path / "q.gguf"
    write_gguf(path, tiny_hf_weights(hidden=64, ffn=96), qtype=getattr(gguf.GGMLQuantizationType, qtype))
    cache = str(tmp_path / "cache")
    first = load_prepared(str(path), "float32", None, cache)
    second = load_prepared(str(path), "float32", None, cache)
    layer = second.model.layers[0]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert isinstance(getattr(layer, name).get_value(), CodedF32), name
    a, b = _state(first.model), _state(second.model)
    for p in a:
        for x, y in zip(a[p][1], b[p][1], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(p))
    calls = _loads_from_source(monkeypatch)
    floats = load_prepared(str(path), "float32", None, cache, codes=False)    # EngineConfig.weight_codes
    assert calls == [str(path)]                       # not the coded entry
    assert isinstance(floats.model.layers[0].wo.get_value(), PanelledF32)
    ids = list(range(2, 40))
    np.testing.assert_array_equal(ReferenceGenerator(second.model).logits(ids),
                                  ReferenceGenerator(floats.model).logits(ids))


@pytest.mark.parametrize("codes", [True, False])
def test_float32_load_panels_and_codes_each_weight_as_read(tmp_path, codes):
    """A float32 load on CPU panels (and codes) each matmul weight as it reads it
    (quantization._float_finisher) and fuses the panelled parts afterwards: every array of
    the prepared model equals preparing the whole float model after the load, also where
    one part of a fused weight has no exact codes (a coded wq and wv beside a float wk)."""
    import gguf

    from jaxinfer.loading import load_model, read_config
    from jaxinfer.quantization import prepare_for_engine, weight_finisher
    from pallas_kernels.f32_matmul.cpu import CodedF32, PanelledF32, available

    assert available()
    path = tmp_path / "q.gguf"
    write_gguf(path, tiny_hf_weights(hidden=64, ffn=96), qtype=gguf.GGMLQuantizationType.Q8_0)
    nudge = lambda p, v: v + 1e-7 if p == "layers.0.wk" else v          # noqa: E731  (no codes)
    finish = weight_finisher(read_config(str(path)), None, codes)
    assert finish is not None
    ours = load_model(str(path), "float32", finish=lambda p, v: finish(p, nudge(p, v))).model
    ours = prepare_for_engine(ours, None, in_place=True, codes=codes)
    ref = load_model(str(path), "float32").model
    ref.layers[0].wk.set_value(nudge("layers.0.wk", ref.layers[0].wk[...]))
    ref = prepare_for_engine(ref, None, in_place=True, codes=codes)
    a, b = _state(ours), _state(ref)
    assert a.keys() == b.keys()
    for p in a:
        assert a[p][0] == b[p][0], p
        for x, y in zip(a[p][1], b[p][1], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(p))
    kinds = {p: type(getattr(ours.layers[i], "wqkv")[...]) for i, p in enumerate(("first", "second"))}
    assert kinds == ({"first": PanelledF32, "second": CodedF32} if codes else {"first": PanelledF32, "second": PanelledF32})


def _int8_q8_model_twice(tmp_path, monkeypatch, tied: bool) -> tuple:
    """A tiny Q8_0 GGUF loaded with int8 weights twice, the second time from the weight
    cache: (path, cache dir, first, second, source loads since the first)."""
    import gguf

    path = tmp_path / "q.gguf"
    w = tiny_hf_weights(hidden=64, ffn=96, tied=tied)
    # 272 rows (a multiple of the kernel's 16-column panels; 12 past the tokenizer's 260, as
    # HF checkpoints pad their vocabularies)
    for name in ("model.embed_tokens.weight", "lm_head.weight")[:1 if tied else 2]:
        w[name] = np.concatenate([w[name], w[name][:12]])
    write_gguf(path, w, qtype=gguf.GGMLQuantizationType.Q8_0)
    cache = str(tmp_path / "cache")
    first = load_prepared(str(path), "float32", "int8", cache)
    calls = _loads_from_source(monkeypatch)
    second = load_prepared(str(path), "float32", "int8", cache)
    assert calls == []                                                  # from the cache
    return path, cache, first, second, calls


def test_int8_model_keeps_its_float_embedding_as_codes(tmp_path, monkeypatch):
    """With int8 weights, an untied model's float32 embedding table (a GGUF's Q8_0
    token_embd) is kept as its exact codes (quantization.code_embedding): a TiedEmbedding
    over a CodedF32, saved and mapped back, whose rows, and so the model's logits, are
    bitwise those of the table kept as floats (``codes=False``)."""
    from jaxinfer.quantization import TiedEmbedding
    from jaxinfer.reference import ReferenceGenerator
    from pallas_kernels.f32_matmul.cpu import CodedF32, available

    assert available()
    path, cache, first, coded, calls = _int8_q8_model_twice(tmp_path, monkeypatch, tied=False)
    emb = coded.model.embed.get_value()
    first_emb = first.model.embed.get_value()
    for x, y in zip(jax.tree.leaves(emb), jax.tree.leaves(first_emb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert isinstance(emb, TiedEmbedding) and isinstance(emb.head, CodedF32)
    floats = load_prepared(str(path), "float32", "int8", cache, codes=False)
    assert calls == [str(path)]                                         # an entry of its own
    table = floats.model.embed.get_value()
    assert not isinstance(table, TiedEmbedding)
    tokens = np.arange(table.shape[0], dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(emb.rows(tokens)), np.asarray(table))
    ids = list(range(2, 40))
    np.testing.assert_array_equal(ReferenceGenerator(coded.model).logits(ids),
                                  ReferenceGenerator(floats.model).logits(ids))


def test_tied_int8_model_reads_its_embedding_from_the_int8_head(tmp_path, monkeypatch):
    """A tied model with int8 weights keeps one int8 table (quantization.share_tied_table):
    its embedding is a TiedEmbedding over the LM head's own QuantizedWeight, made once in
    the load (weight_finisher) and the same as preparing the float model; the weight cache
    saves it as a reference to the head (no table files) and maps it back shared; each row
    is within half a quantization step of the float table's. A float table that is not the
    head's (the tie flag set on other numbers) stays as it is."""
    from jaxinfer.loading import load_model
    from jaxinfer.quantization import TiedEmbedding, prepare_for_engine, share_tied_table
    from pallas_kernels.quantized_matmul.xla import QuantizedWeight

    path, cache, first, again, calls = _int8_q8_model_twice(tmp_path, monkeypatch, tied=True)
    entry = next(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    names = [w_["path"] for w_ in json.loads((entry / "weights.json").read_text())["weights"]]
    assert ["embed"] in names and not any(f.name.startswith(f"{names.index(['embed']):04d}.")
                                          for f in entry.iterdir())    # a reference, no arrays
    floats = load_model(str(path), "float32")
    table = np.asarray(floats.model.embed.get_value())
    prepared_ = prepare_for_engine(floats.model, "int8")
    for m in (first.model, again.model, prepared_):
        emb, head = m.embed.get_value(), m.lm_head.get_value()
        assert isinstance(emb, TiedEmbedding) and isinstance(head, QuantizedWeight) and head.bits == 8
        assert emb.head.q is head.q and emb.head.scales is head.scales
        np.testing.assert_array_equal(np.asarray(head.q), np.asarray(first.model.lm_head.get_value().q))
        rows = np.asarray(emb.rows(np.arange(table.shape[0], dtype=np.int32)))
        step = np.asarray(head.scales)[:, None]
        assert rows.dtype == np.float32 and np.all(np.abs(rows - table) <= step * (0.5 + 1e-5))
    other = load_model(str(path), "float32").model
    other.embed.set_value(other.embed.get_value() + 0.1)                # not the head's numbers
    other = prepare_for_engine(other, "int8", codes=False)
    assert isinstance(other.lm_head.get_value(), QuantizedWeight)
    assert isinstance(other.embed.get_value(), jax.Array)                # the table kept
    kept = share_tied_table(other).embed.get_value()
    assert isinstance(kept, jax.Array)


def test_coded_table_in_slabs_equals_the_whole_table_coded():
    """quantization.coded_table codes the table a slab of 4,096 rows at a time (a cold load's
    transient is one slab, not the transposed table): the same codes, scales and offsets as
    coding the whole table at once, and rows bitwise the table's; a table without exact
    codes stays as it is."""
    from jaxinfer.quantization import TiedEmbedding, coded_table
    from pallas_kernels.f32_matmul.codes import encode
    from pallas_kernels.f32_matmul.cpu import available, panel

    assert available()
    rng = np.random.default_rng(0)
    V, D = 2 * 4096 + 32, 64                          # three slabs, the last a short one
    codes = rng.integers(-127, 128, size=(V, D)).astype(np.float32)
    codes[:, ::32] = 127                              # each block's largest code, as Q8_0's scale gives
    scale = rng.uniform(1e-3, 1e-2, size=(V, D // 32, 1)).astype(np.float16).astype(np.float32)   # Q8_0's d
    table = jnp.asarray((codes.reshape(V, D // 32, 32) * scale).reshape(V, D))   # Q8_0-like blocks
    got = coded_table(table)
    assert isinstance(got, TiedEmbedding)
    whole = encode(panel(table.T))
    for f in ("codes", "scale", "offset"):
        np.testing.assert_array_equal(np.asarray(getattr(got.head, f)), np.asarray(getattr(whole, f)), err_msg=f)
    np.testing.assert_array_equal(np.asarray(got.rows(np.arange(V, dtype=np.int32))), np.asarray(table))
    noisy = table.at[5, 3].add(1e-7)
    assert coded_table(noisy) is noisy

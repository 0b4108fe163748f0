"""Weight-only int8 / int4 quantization at load time, and the attention / matmul dispatch."""

from __future__ import annotations

import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.engine_config import EngineConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.quantization import int4_group, is_quantized, quantize_model, weight_bytes
from jaxinfer.reference import ReferenceGenerator

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tp_worker import ENGINE_KW, PROMPTS, tiny_loaded  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded("llama_8q4kv")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_equals_reference_on_the_same_weights(tiny, mode):
    """The engine's quantized step (batched, chunked) gives exactly the tokens the reference
    generator gives alone on the same quantized weights; the caller's model stays float."""
    from jaxinfer.matmul import int4_kernel_available

    eng = Engine(loaded=tiny, progress=False, quantization=mode, kv_cache_dtype="model", **ENGINE_KW)
    assert is_quantized(eng.loaded.model) and not is_quantized(tiny.model)
    if mode == "int4" and int4_kernel_available():      # the C++ kernel's 4-bit panels, not XLA's int4
        assert eng.loaded.model.layers[0].w_gate_up[...].offsets is not None
    got = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]
    ref = ReferenceGenerator(eng.loaded.model)
    want = [ref.generate([p], [GREEDY], [0], pad_to=64)[0].token_ids for p in PROMPTS]
    assert got == want
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]
    assert st["kv_cache_dtype"] == "float32"
    # by default quantized weights come with int8 KV pages (engine_config.kv_cache_dtype); on
    # this model their tokens are the float pages' (asserted for int8 pages alone below)
    default = Engine(loaded=tiny, progress=False, quantization=mode, **ENGINE_KW)
    assert default.stats()["kv_cache_dtype"] == "int8"
    assert [o.outputs[0].token_ids for o in default.generate(PROMPTS, GREEDY)] == want


def test_quantized_weight_bytes(tiny):
    """Matmul weights shrink about 4x (int8) and about 7x (int4, group scales; on CPU with
    the C++ kernel the layers' 4-bit panels about 6.4x, f16 scale and offset per 32 rows,
    and the LM head int8); the float embedding table is kept."""
    from jaxinfer.matmul import int4_kernel_available
    from jaxinfer.quantization import head_bits

    cfg = tiny.config
    f32 = weight_bytes(tiny.model)
    emb = cfg.vocab_size * cfg.hidden_size * 4
    # RMSNorm vectors stay float: two per layer and the final one (+ Qwen3's q/k norms)
    norms = ((2 * cfg.num_layers + 1) * cfg.hidden_size
             + (2 * cfg.num_layers * cfg.head_dim if cfg.qk_norm else 0)) * 4
    mats = f32 - emb - norms
    q8 = weight_bytes(quantize_model(tiny.model, "int8")) - emb - norms
    assert 3.5 < mats / q8 < 4.0, (mats, q8)
    if int4_kernel_available():
        assert head_bits(4) == 8
        m4 = quantize_model(tiny.model, "int4")
        head = m4.lm_head.get_value()
        assert head.bits == 8 and head.offsets is None
        layers = [v for path, v in nnx.iter_graph(m4.layers) if isinstance(v, nnx.Param) and hasattr(v[...], "q")]
        assert layers and all(v[...].offsets is not None for v in layers)       # every layer weight: panels
        for v in layers:
            K, N = v[...].shape
            assert sum(x.nbytes for x in jax.tree.leaves(v[...])) == K * N * 5 // 8   # 4 bits + 2 f16 per 32
        head_f32 = cfg.hidden_size * cfg.vocab_size * 4
        assert 3.5 < head_f32 / (sum(x.nbytes for x in jax.tree.leaves(head))) < 4.0
    else:
        q4 = weight_bytes(quantize_model(tiny.model, "int4")) - emb - norms
        assert 6.0 < mats / q4 < 8.0, (mats, q4)
    assert int4_group(cfg) == 64     # 64 | hidden 64 and MLP 128; 128 does not divide 64


def test_quantization_errors_name_the_problem(tiny):
    with pytest.raises(ValueError, match="quantization: must be None, 'int8' or 'int4'"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="quantization with tensor_parallel_size > 1"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)


def test_dispatch_picks_kernels_by_backend():
    from jaxinfer.attention import dispatch
    from pallas_kernels.attention.xla import ragged_paged_attention
    from pallas_kernels.attention import pallas as rpa

    from pallas_kernels.attention import cpu as cpu_attention

    # CPU: the C++ kernel for float32 and int8 pages where it builds, else the jnp path
    want = ("cpp", cpu_attention.ragged_paged_attention) if cpu_attention.available() else \
        ("xla", ragged_paged_attention)
    assert dispatch.select("auto", "cpu") == want
    assert dispatch.select("auto", "cpu", kv_dtype=jnp.bfloat16) == ("xla", ragged_paged_attention)
    assert dispatch.select("xla", "cpu") == ("xla", ragged_paged_attention)
    # int8 pages too (the kernel dequantizes the rows it reads); bf16 pages take the jnp path
    want_q8 = want if cpu_attention.available() else ("xla", ragged_paged_attention)
    assert dispatch.select("auto", "cpu", kv_quantized=True, kv_dtype=jnp.int8) == want_q8
    with pytest.raises(ValueError, match="'cpp' needs the CPU backend and a float32 or int8 KV cache"):
        dispatch.select("cpp", "cpu", kv_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="'cpp' needs the CPU backend"):
        dispatch.select("cpp", "gpu")
    assert dispatch.select("auto", "tpu") == ("pallas-tpu", rpa.ragged_paged_attention_tpu)
    assert dispatch.select("auto", "gpu") == ("pallas-gpu", rpa.ragged_paged_attention_gpu)
    assert dispatch.select("xla", "gpu")[0] == "xla"
    with pytest.raises(ValueError, match="'pallas' needs a TPU or GPU backend, this one is 'cpu'"):
        dispatch.select("pallas", "cpu")
    # weight matmuls: quantized weights on GPU take XLA's path (the plain / invariant dots,
    # which route a QuantizedWeight to quantized_matmul), on TPU the Pallas kernel
    from jaxinfer import matmul as M
    assert M.select(True, "gpu") is M.tiled_matmul and M.select(False, "gpu") is M.matmul
    assert M.name("int8", jnp.float32, "gpu") == "xla" and M.name("int8", jnp.float32, "tpu") == "pallas"
    assert M.select(True, "tpu") not in (M.tiled_matmul, M.matmul)
    with pytest.raises(ValueError, match="unknown implementation 'flash'"):
        dispatch.select("flash")


@pytest.mark.slow
def test_default_model_int8_quality():
    """SmolLM2 on MT-Bench prompts: int8 weights (the embedding read from the int8 LM head)
    keep the next-token distribution close to float32, mean KL(f32 || int8) < 0.01 (issue 6's bar), measured teacher-forced over the
    last 32 positions of each chat-templated prompt. benchmarks/quant_quality.py measures it
    along the float32 greedy continuations of all 80 questions, with greedy agreement."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    from quant_quality import DATA, prompts

    from jaxinfer.loading import load_model
    from jaxinfer.quality import kl_divergence, tail_logits

    from jaxinfer.quantization import TiedEmbedding, prepare_for_engine

    loaded = load_model(None, "float32")
    q8 = prepare_for_engine(loaded.model, "int8")      # as the engine runs it: one int8 table
    assert isinstance(q8.embed.get_value(), TiedEmbedding)
    kls = [kl_divergence(tail_logits(loaded.model, p, 32), tail_logits(q8, p, 32))
           for p in prompts(loaded.tokenizer, DATA, 8)]
    kl = np.concatenate(kls)
    assert kl.shape == (8 * 32,)
    assert 0 < kl.mean() < 0.01, kl.mean()


# ---- int8 KV pages --------------------------------------------------------------------

def test_int8_pages_attention_matches_reference_and_ignores_unused_pages():
    """The XLA attention reading int8 pages (values x per-token scales) equals the reference
    on the same pages dequantized; NaN scales in unused pages and page 0 change nothing."""
    import jax.numpy as jnp

    from pallas_kernels.attention.xla import ragged_paged_attention
    from jaxinfer.engine.kv_cache import QuantizedPages, quantize_kv
    from pallas_kernels.attention.pallas import reference_on_step_layout

    rng = np.random.default_rng(0)
    N, ps, KVH, D, H = 12, 16, 2, 32, 4
    kv = rng.standard_normal((2, N * ps, KVH, D)).astype(np.float32)
    pages = []
    for x in kv:
        q, s = quantize_kv(jnp.asarray(x))
        s = np.asarray(s).reshape(N, ps, KVH).copy()
        s[[0, 10, 11]] = np.nan                                   # page 0 and two unused pages
        pages.append(QuantizedPages(jnp.asarray(q).reshape(N, ps, KVH, D), jnp.asarray(s)))
    page_table = jnp.asarray([[3, 4, 0, 0], [5, 6, 7, 1], [8, 9, 2, 0]], jnp.int32)
    kv_lens = jnp.asarray([20, 60, 40], jnp.int32)
    q_lens = jnp.asarray([1, 1, 17], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2 + 32, H, D)).astype(np.float32))
    kw = dict(num_decode=2, prefill_chunk=32, sm_scale=D ** -0.5)
    got = np.asarray(ragged_paged_attention(q, pages[0], pages[1], kv_lens, q_lens, page_table, **kw))
    want = np.asarray(reference_on_step_layout(q, pages[0], pages[1], kv_lens, q_lens, page_table, **kw))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # quantization error of the values themselves: at most half a step of each token's scale
    deq = np.asarray(pages[0].q.reshape(N * ps, KVH, D), np.float32) * np.asarray(
        quantize_kv(jnp.asarray(kv[0]))[1])[..., None]
    assert np.max(np.abs(deq - kv[0]) / (np.abs(kv[0]).max(-1, keepdims=True) / 127)) <= 0.5 + 1e-4


def test_int8_kv_engine_is_batch_invariant_and_fits_more_pages(tiny):
    """int8 pages: a request's tokens are the same alone and batched (per-token scales), no
    page leaks, the tiny model's greedy tokens equal the float cache's, and a byte budget
    holds (D * 2) / (D + 4) times the pages a bf16 cache would (f32 scales included)."""
    from jaxinfer.engine.kv_cache import KVCacheSpec

    eng = Engine(loaded=tiny, progress=False, kv_cache_dtype="int8", **ENGINE_KW)
    batched = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]
    alone = [eng.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]
    # the C++ kernel reads the int8 pages, inside the layer loop (one layer compiled)
    from pallas_kernels.attention import cpu as cpu_attention
    assert st["kernels"]["attention"] == ("cpp" if cpu_attention.available() else "xla")
    assert eng.replicas[0].runner.layer_loop == cpu_attention.available()
    f32 = Engine(loaded=tiny, progress=False, **ENGINE_KW)
    assert batched == [o.outputs[0].token_ids for o in f32.generate(PROMPTS, GREEDY)]
    cfg = tiny.config
    dims = dict(num_layers=cfg.num_layers, page_size=16, num_kv_heads=cfg.num_kv_heads, head_dim=64)
    budget = 1 << 24
    n_bf16 = KVCacheSpec.num_pages_for_budget(budget, dtype="bfloat16", **dims)
    n_int8 = KVCacheSpec.num_pages_for_budget(budget, dtype="int8", **dims)
    assert abs(n_int8 / n_bf16 - 128 / 68) < 0.01, (n_int8, n_bf16)


def test_kv_cache_dtype_errors():
    from jaxinfer.attention import dispatch

    with pytest.raises(ValueError, match="kv_cache_dtype: must be None"):
        EngineConfig(kv_cache_dtype="fp8")
    # the Pallas kernels read int8 pages too (tests/test_pallas_attention.py): auto keeps them
    assert dispatch.select("auto", "gpu", kv_quantized=True)[0] == "pallas-gpu"
    assert dispatch.select("auto", "tpu", kv_quantized=True)[0] == "pallas-tpu"
    from pallas_kernels.attention import cpu as cpu_attention
    assert dispatch.select("auto", "cpu", kv_quantized=True)[0] == ("cpp" if cpu_attention.available() else "xla")


def test_kv_cache_dtype_auto_follows_the_weights():
    """"auto" (None) stores int8 pages exactly when the weights are quantized and nothing
    speculates; "model" and "int8" are what they say (engine_config.kv_cache_dtype)."""
    from jaxinfer.engine_config import kv_cache_dtype

    for q in (None, "int8", "int4"):
        want_auto = None if q is None else "int8"
        assert kv_cache_dtype(EngineConfig(quantization=q)) == want_auto
        assert kv_cache_dtype(EngineConfig(quantization=q, kv_cache_dtype="auto")) == want_auto
        assert kv_cache_dtype(EngineConfig(quantization=q, kv_cache_dtype="model")) is None
        assert kv_cache_dtype(EngineConfig(quantization=q, kv_cache_dtype="int8")) == "int8"
        # speculation asks for speed: "auto" keeps the model's dtype
        assert kv_cache_dtype(EngineConfig(quantization=q, speculative_method="ngram")) is None
        assert kv_cache_dtype(EngineConfig(quantization=q, speculative_method="ngram",
                                           kv_cache_dtype="int8")) == "int8"


@pytest.mark.parametrize("V,step", [(256, 64), (272, 64), (272, 4096)])
def test_head_from_table_in_slabs_equals_the_whole_head_quantized(V, step):
    """A tied int8 model's LM head made from its table a slab of rows at a time
    (quantization._head_from_table: the load's transient is one slab) is bitwise the whole
    transposed table quantized and laid out for the kernel; a last slab that does not fill
    the kernel's 32-column panels falls back to the whole table."""
    from jaxinfer.quantization import _head_from_table, _weight_quantizer

    rng = np.random.default_rng(V)
    table = jnp.asarray(rng.standard_normal((V, 64)).astype(np.float32))
    quantized = _weight_quantizer(None, 8)              # (int8 reads no config)
    got, whole = _head_from_table(table, quantized, step), quantized(table.T)
    assert (got.panel, got.bits, got.shape) == (whole.panel, whole.bits, (64, V))
    np.testing.assert_array_equal(np.asarray(got.q), np.asarray(whole.q))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(whole.scales))

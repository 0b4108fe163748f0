"""Mixture of experts (models/mixtral.py, models/moe.py) against HF transformers: Mixtral,
Qwen3-MoE and Qwen2-MoE (shared expert), tiny random-weight models saved with
``save_pretrained`` (one tensor per expert, as this transformers writes them).

Checked here: logits within 1e-4 (float32) on prompts longer than Mixtral's window; the
grouped matmul against a per-pair numpy reference (experts held elsewhere give zeros);
the MoE block's rows bitwise the same alone and in batches of other sizes on XLA's own
dots (bf16, float32), where no kernel makes that hold by construction; tensor parallelism
2 on fake CPU devices (a subprocess) with the experts split over the model axis, greedy
tokens equal to transformers'; weight quantization refused naming the family; int8 KV
pages; unsupported configs refused naming the field. The engine itself (batched, chunked
prefill and preemption forced, 32 greedy tokens, bitwise alone vs batched, no compile
after warm-up) runs Mixtral and Qwen3-MoE in tests/test_hf_oracle.py's FAMILIES.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from test_hf_oracle import MIXTRAL, QWEN3_MOE, TINY, Family, build_family  # noqa: E402
from tp_worker import run_on_fake_devices  # noqa: E402

CASES = {
    "mixtral": ("MixtralConfig", MIXTRAL),
    "qwen3_moe": ("Qwen3MoeConfig", QWEN3_MOE),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96)),
}
V = TINY["vocab_size"]
PROMPTS = [np.random.RandomState(i).randint(3, V, size=n).tolist() for i, n in enumerate((5, 40, 70))]
TAIL = 16
# Engine runs (TP and Qwen2-MoE): the shapes of tests/test_gpt_families.py (4 decode slots,
# 2 x 16-position prefill slots, so the 40- and 70-token prompts are chunked).
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(4,), prefill_buckets=((2, 16),),
                 page_buckets=(8,))
TOKENS = 16
_BUILT: dict[str, tuple[object, str]] = {}


def checkpoint(case: str, root: pathlib.Path) -> tuple[object, str]:
    """(HF model, checkpoint dir), built once per case in this process."""
    if case not in _BUILT:
        cls, fields = CASES[case]
        out = root / case
        hf = build_family(Family(case, lambda: getattr(transformers, cls)(**{**TINY, **fields})), str(out))
        _BUILT[case] = (hf, str(out))
    return _BUILT[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case, root):
    from jaxinfer.loading import load_model
    from jaxinfer.quality import tail_logits

    hf, path = checkpoint(case, root)
    loaded = load_model(path)
    assert loaded.config.moe is not None and loaded.config.moe.family == case
    for ids in PROMPTS:
        count = min(TAIL, len(ids))
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -count:].numpy()
        err = _rel_err(tail_logits(loaded.model, ids, count), want)
        assert err < 1e-4, f"{case}: prompt of {len(ids)} tokens, relative logit error {err:.2e}"


def _random_experts(E: int, D: int, F: int, dtype, seed: int = 0):
    import jax

    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    g = (0.2 * jax.random.normal(ks[0], (E, D, F))).astype(dtype)
    u = (0.2 * jax.random.normal(ks[1], (E, D, F))).astype(dtype)
    d = (0.2 * jax.random.normal(ks[2], (E, F, D))).astype(dtype)
    r = jax.random.normal(ks[3], (D, E)).astype(dtype)
    return g, u, d, r


def test_grouped_matmul_matches_per_pair_reference():
    """Every (token, expert) pair's output against numpy float64, on a whole expert set
    and on the second half of it (a tensor-parallel device's share: others give zeros)."""
    import jax.numpy as jnp

    from jaxinfer.models import moe

    T, k, E, D, F = 37, 3, 8, 16, 24
    g, u, d, _ = _random_experts(E, D, F, jnp.float32)
    rng = np.random.RandomState(0)
    x = rng.randn(T, D).astype(np.float32)
    experts = np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), axis=1).astype(np.int32)
    G, U, Dn = (np.asarray(a, np.float64) for a in (g, u, d))

    def ref(t, e):
        a = x[t].astype(np.float64) @ G[e]
        return ((a / (1 + np.exp(-a))) * (x[t] @ U[e])) @ Dn[e]

    silu = lambda a: a * (1 / (1 + jnp.exp(-a)))   # noqa: E731
    mm = lambda a, w: a @ w                          # noqa: E731
    full = np.asarray(moe.grouped_expert_mlp(jnp.asarray(x), jnp.asarray(experts), g, u, d, silu, mm))
    half = np.asarray(moe.grouped_expert_mlp(jnp.asarray(x), jnp.asarray(experts), g[4:], u[4:], d[4:],
                                             silu, mm, first_expert=4))
    for t in range(T):
        for j, e in enumerate(experts[t]):
            np.testing.assert_allclose(full[t, j], ref(t, e), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(half[t, j], ref(t, e) if e >= 4 else 0.0, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_block_rows_are_batch_invariant_on_xla_dots(dtype):
    """A sparse layer's MLP (routing, grouped experts, combine) for a token alone and among
    2..299 others gives the same bits on XLA's own dots (matmul.xla_matmul, invariant
    tiles; no C++ kernel), whose kernel depends on the row count: the expert tiles keep it
    fixed, and the router logits keep their bf16 rounding (layers.as_computed)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer import matmul as M
    from jaxinfer.models.mixtral import MixtralForCausalLM

    cfg = config_from_hf({"architectures": ["MixtralForCausalLM"], **TINY, "num_local_experts": 8,
                               "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1})
    layer = MixtralForCausalLM(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)).layers[0]
    mm = functools.partial(M.xla_matmul, invariant=True)
    block = jax.jit(lambda x: layer.mlp(x, mm, None))
    xs = jnp.asarray(np.random.RandomState(2).randn(300, 64), jnp.dtype(dtype))
    rows = np.asarray(block(xs))
    logits = mm(xs, layer.router[...])
    assert len(set(map(tuple, np.asarray(jax.lax.top_k(logits.astype(jnp.float32), 2)[1])))) > 10, \
        "routing should spread the tokens over many expert pairs"
    for n in (1, 2, 3, 17, 64, 129):
        got = np.asarray(block(xs[:n]))
        assert np.array_equal(got.view(np.uint8), rows[:n].view(np.uint8)), f"{dtype}: batch of {n}"


def test_qwen2_moe_engine_matches_hf(root):
    """Qwen2-MoE through the single-device engine, whose CPU layout fuses the shared
    expert's gate / up weights (quantization.prepare_float_for_cpu): greedy = transformers."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from test_gpt_families import hf_greedy

    hf, path = checkpoint("qwen2_moe", root)
    engine = Engine(loaded=load_model(path), progress=False, **ENGINE_KW)
    layer = engine.loaded.model.layers[0]
    assert hasattr(layer, "w_gate_up") or not _f32_kernel(), "expected the fused shared expert"
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in engine.generate(PROMPTS, greedy)]
    assert got == [hf_greedy(hf, p, TOKENS) for p in PROMPTS]


def _f32_kernel() -> bool:
    from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul

    return cpu_f32_matmul.available()


def test_weight_quantization_refused_and_int8_kv_close(root):
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from jaxinfer.quality import tail_logits

    loaded = load_model(checkpoint("mixtral", root)[1])
    with pytest.raises(ValueError, match="quantization: int8 weights are not supported for MixtralForCausalLM"):
        Engine(loaded=loaded, progress=False, quantization="int8", num_pages=8)
    ids = PROMPTS[2]
    base = tail_logits(loaded.model, ids, TAIL)
    err = _rel_err(tail_logits(loaded.model, ids, TAIL, kv_int8=True), base)
    assert 0 < err < 0.05, f"int8 KV: relative logit error {err:.2e}"


def test_unsupported_moe_configs_are_refused():
    def cfg(arch, **d):
        return config_from_hf({"architectures": [arch], **TINY, **d})

    with pytest.raises(ValueError, match="num_experts_per_tok: 9 is more than the 8 experts"):
        cfg("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts: missing"):
        cfg("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    with pytest.raises(ValueError, match="use_sliding_window: .*Qwen2MoeForCausalLM"):
        cfg("Qwen2MoeForCausalLM", num_experts=4, moe_intermediate_size=32, use_sliding_window=True)
    with pytest.raises(ValueError, match="rope_scaling.rope_type"):
        cfg("MixtralForCausalLM", num_local_experts=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the model's 6 experts"):
        from jaxinfer.sharding import check_tensor_parallel
        check_tensor_parallel(cfg("Qwen2MoeForCausalLM", num_experts=6, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=4), 4)


def test_tensor_parallel_2_matches_hf(root):
    """tp=2 on fake CPU devices: each device holds half of the experts (and of the heads,
    MLP and vocabulary); greedy tokens equal transformers' for every MoE family."""
    from test_gpt_families import hf_greedy

    dirs = {c: checkpoint(c, root)[1] for c in CASES}
    want = {c: [hf_greedy(checkpoint(c, root)[0], p, TOKENS) for p in PROMPTS] for c in CASES}
    got = run_on_fake_devices(__file__, dirs, devices=8, timeout=900)
    for c in CASES:
        assert got[c]["expert_spec"] == ["model", None, None], f"{c}: experts not split over the model axis"
        assert got[c]["experts_per_device"] == CASES[c][1].get("num_experts",
                                                              CASES[c][1].get("num_local_experts")) // 2
        assert got[c]["tokens"] == want[c], f"{c}: tp=2 tokens differ from transformers'"


def _tp_worker(dirs: dict[str, str]) -> None:
    """Subprocess body of test_tensor_parallel_2_matches_hf: prints {case: {...}}."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    out = {}
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for case, path in dirs.items():
        eng = Engine(loaded=load_model(path), progress=False, tensor_parallel_size=2, **ENGINE_KW)
        w = eng.loaded.model.layers[0].moe_gate[...]
        out[case] = {"tokens": [r.outputs[0].token_ids for r in eng.generate(PROMPTS, greedy)],
                     "expert_spec": list(w.sharding.spec),
                     "experts_per_device": w.addressable_shards[0].data.shape[0]}
    print(json.dumps(out))


if __name__ == "__main__":
    _tp_worker(json.loads(sys.argv[1]))

"""Phi-3 (models/phi3.py) against HF transformers: longrope in both regimes.

transformers picks longrope's factor set per forward (long once the sequence passes
original_max_position_embeddings); the engine picks one per engine from its max_model_len
(models/base.fit_context). Each regime is checked where transformers makes the same
choice: prompts within the original length with the short factors, prompts past it with
the long ones (logits within 1e-4), and the engine with max_model_len past it on prompts
past it (greedy 32 tokens identical to transformers, batched with chunked prefill and
preemption forced, and alone, bitwise). The short regime through the engine, the sliding
window and partial rotary are in tests/test_hf_oracle.py's FAMILIES.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from jaxinfer.models.base import fit_context  # noqa: E402
from jaxinfer.quality import tail_logits  # noqa: E402
from test_hf_oracle import (PHI3_LONGROPE, TINY, TINY_ENGINE_KW, Family, alone_vs_batched,  # noqa: E402
                            build_family, check_run, compare_with_hf, run_engine)

ORIG = 32          # original_max_position_embeddings: prompts past it take the long factors
WINDOW = 24
PHI3 = dict(TINY, sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=ORIG,
            pad_token_id=0, rope_scaling=PHI3_LONGROPE)
TAIL = 16


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(HF model, checkpoint dir) of a tiny Phi-3 with longrope (original length 32)."""
    out = tmp_path_factory.mktemp("phi3")
    hf = build_family(Family("phi3", lambda: transformers.Phi3Config(**PHI3)), str(out))
    return hf, str(out)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_logits_match_hf_in_both_longrope_regimes(phi3):
    hf, path = phi3
    loaded = load_model(path)
    assert loaded.config.rope_scaling.rope_type == "longrope" and loaded.config.rotary_dim == 8
    short, long = fit_context(loaded.model, ORIG), fit_context(loaded.model, 128)
    assert not short.cfg.rope_scaling.use_long and long.cfg.rope_scaling.use_long
    assert not loaded.model.cfg.rope_scaling.use_long          # the given module is untouched
    rng = np.random.RandomState(0)
    for n in (20, 32, 33, 57, 100):            # within / past the original length and the window
        ids = rng.randint(3, TINY["vocab_size"], size=n).tolist()
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -TAIL:].numpy()
        right, wrong = (long, short) if n > ORIG else (short, long)
        err = _rel_err(tail_logits(right, ids, TAIL), want)
        assert err < 1e-4, f"prompt of {n} tokens: relative logit error {err:.2e}"
        # the other factor set must be far off, or this test could not tell them apart
        assert _rel_err(tail_logits(wrong, ids, TAIL), want) > 1e-3, n


def test_engine_long_regime_matches_hf(phi3):
    """max_model_len 128 > 32: the long factors for every token; prompts past 32 tokens, so
    transformers uses them throughout too."""
    hf, path = phi3
    engine = Engine(loaded=load_model(path), progress=False, **TINY_ENGINE_KW)
    assert engine.runner.cfg.rope_scaling.use_long
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, TINY["vocab_size"], size=n).tolist() for n in (33, 61, 40, 47, 36, 52)]
    max_tokens = [32, 12, 24, 16, 32, 8]
    run = run_engine(engine, prompts, max_tokens, seed=0)
    check_run(run, len(prompts))
    errors = compare_with_hf(hf, run, prompts, max_tokens)
    assert not errors, "Phi-3 (long regime): engine differs from HF transformers:\n" + "\n".join(errors)
    errors = alone_vs_batched(engine, run, prompts, max_tokens)
    assert not errors, "Phi-3: logprobs not bitwise batch-invariant:\n" + "\n".join(errors)


def test_unsupported_phi3_configs_are_refused():
    def cfg(**d):
        return config_from_hf({"architectures": ["Phi3ForCausalLM"], **TINY, **d})

    with pytest.raises(ValueError, match="rope_scaling.rope_type: unsupported 'dynamic'"):
        cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling.long_factor: longrope needs a list"):
        cfg(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8})
    with pytest.raises(ValueError, match="rope_scaling.short_factor: has 4 entries, expected .* 8"):
        cfg(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    with pytest.raises(ValueError, match="partial_rotary_factor: must be in"):
        cfg(partial_rotary_factor=1.5)
    with pytest.raises(ValueError, match="partial_rotary_factor: rotates 5 features"):
        cfg(partial_rotary_factor=0.3125)
    # older configs name longrope "su"
    c = cfg(rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
            original_max_position_embeddings=64)
    assert c.rope_scaling.rope_type == "longrope" and c.rope_scaling.factor == 256 / 64


def test_quantized_weights_and_int8_kv_stay_close(phi3):
    """int8 / int4 weights (split from the fused tensors, re-fused for the CPU kernels)
    and int8 KV pages run and stay near float32 (thresholds of tests/test_gpt_families.py)."""
    from jaxinfer.quantization import quantize_model

    model = load_model(phi3[1]).model
    ids = np.random.RandomState(2).randint(3, TINY["vocab_size"], size=30).tolist()
    base = tail_logits(model, ids, TAIL)
    for mode, tol in (("int8", 0.05), ("int4", 0.35)):
        err = _rel_err(tail_logits(quantize_model(model, mode), ids, TAIL, kv_int8=mode == "int8"), base)
        assert 0 < err < tol, f"{mode}: relative logit error {err:.2e}"


def test_tensor_parallel_2_matches_hf(tmp_path):
    """tp=2 on two fake CPU devices (tests/test_gpt_families.py's subprocess worker): the
    q/k/v and gate/up split from the fused tensors shard like Llama's; the short regime
    (original length 128 = the worker's max_model_len)."""
    from test_gpt_families import GREEDY, PROMPTS, hf_greedy
    from tp_worker import run_on_fake_devices

    hf = build_family(Family("phi3-short", lambda: transformers.Phi3Config(
        **{**PHI3, "original_max_position_embeddings": 128})), str(tmp_path))
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    worker = str(pathlib.Path(__file__).with_name("test_gpt_families.py"))
    assert run_on_fake_devices(worker, {"phi3": str(tmp_path)}, devices=2)["phi3"] == want

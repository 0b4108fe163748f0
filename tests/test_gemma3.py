"""Gemma 3 against HF transformers (torch CPU, float32) on a tiny random-weight model built
from a config (no download): sliding and global layers with their own rotary bases (linear
scaling on the global ones), q/k norms, four (1 + w) norms per layer, scaled embeddings,
final soft-capping. Logits within 1e-4 on prompts longer than the window; greedy tokens
identical through the engine (batched, chunked prefill forced, no compile after warm-up)
and alone; int8/int4 weights and int8 KV pages; bad configs refused naming the field."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import LoadedModel, build_model, hf_tensors_to_flat  # noqa: E402
from jaxinfer.reference import ReferenceGenerator  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tp_worker import ByteTokenizer  # noqa: E402

WINDOW = 16
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            query_pre_attn_scalar=24, max_position_embeddings=256, final_logit_softcapping=8.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
# Prompts: shorter than the window, and up to four windows long.
LENS = (5, 23, 40, 64)
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),),
                 page_buckets=(8,))
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class CompileCounter:
    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, secs, **kw):
        if self.active and name == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


def hf_config_dict(**overrides) -> dict:
    d = transformers.Gemma3TextConfig(**{**TINY, **overrides}).to_dict()
    d["architectures"] = ["Gemma3ForCausalLM"]
    return d


@pytest.fixture(scope="module")
def tiny():
    """(HF model, our LoadedModel, prompts) sharing the same random weights."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # norms start at 0 ((1 + w) form): perturb them so each one is tested; a wider
            # embedding spreads the logits so greedy decoding is not a toss-up.
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "embed" in name:
                p.mul_(4.0)
    cfg = config_from_hf(hf_config_dict())
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    model = build_model(cfg, hf_tensors_to_flat(cfg, sd), np.float32)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, TINY["vocab_size"], size=n).tolist() for n in LENS]
    return hf, LoadedModel(cfg, model, ByteTokenizer(), {}, "tiny-gemma3"), prompts


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_config_reads_gemma_fields(tiny):
    cfg = tiny[1].config
    assert cfg.layer_types == tuple(TINY["layer_types"]) and cfg.sliding_window == WINDOW
    assert cfg.layer_rope(0) == (1000.0, None)
    assert cfg.layer_rope(1)[0] == 100000.0 and cfg.layer_rope(1)[1].factor == 2.0
    assert cfg.attn_scale == 24 ** -0.5 and cfg.final_soft_cap == 8.0
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.qk_norm and cfg.tie_word_embeddings


def test_logits_match_hf(tiny):
    hf, loaded, prompts = tiny
    for ids in (prompts[1], prompts[3]):     # past the window: 23 and 64 tokens
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        for gen in (ReferenceGenerator(loaded.model),
                    ReferenceGenerator(loaded.model, attention="dense", batch_invariant=False)):
            got = gen.logits(ids)
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            assert rel < 1e-4, f"prompt of {len(ids)}: max relative logit error {rel:.2e}"


def test_window_and_soft_cap_are_exercised(tiny):
    """Without the window (or the cap) the logits differ past the window: the cases above
    test both."""
    hf, loaded, prompts = tiny
    import dataclasses

    ids = prompts[-1]
    base = ReferenceGenerator(loaded.model).logits(ids)
    for change in (dict(layer_types=None, sliding_window=None), dict(final_soft_cap=None)):
        other = build_model(dataclasses.replace(loaded.config, **change),
                            {k: np.asarray(v) for k, v in _flat(loaded).items()}, np.float32)
        diff = np.abs(ReferenceGenerator(other).logits(ids) - base)
        assert diff[WINDOW:].max() > 1e-3, change
    assert np.abs(base).max() <= 8.0          # capped


def _flat(loaded):
    from jaxinfer.models.base import flat_params

    return flat_params(loaded.model)


def test_engine_greedy_matches_hf_batched_and_alone(tiny):
    """All prompts at once (batched, 32-token prefill chunks) and each alone: 32 greedy
    tokens identical to HF's; no compile after the engine's warm-up; no page leaked."""
    hf, loaded, prompts = tiny
    want = [hf_greedy(hf, p, 32) for p in prompts]
    eng = Engine(loaded=loaded, progress=False, **ENGINE_KW)
    COMPILES.count, COMPILES.active = 0, True
    try:
        batched = [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)]
        alone = [eng.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    finally:
        COMPILES.active = False
    assert batched == want
    assert alone == want
    assert COMPILES.count == 0, f"{COMPILES.count} compiles after warm-up"
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_equals_reference(tiny, mode):
    """int8/int4 weights work for Gemma 3: the engine (batched, chunked) gives the tokens the
    reference generator gives alone on the same quantized model."""
    _, loaded, prompts = tiny
    eng = Engine(loaded=loaded, progress=False, quantization=mode, kv_cache_dtype="model", **ENGINE_KW)
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, SHORT)]
    ref = ReferenceGenerator(eng.loaded.model)
    want = [ref.generate([q], [SHORT], [0], pad_to=128)[0].token_ids for q in prompts]
    assert got == want


def test_int8_kv_pages_batch_invariant(tiny):
    """int8 KV pages: each request's tokens are the same alone and batched, and equal the
    float cache's on this model; no page leaked."""
    _, loaded, prompts = tiny
    eng = Engine(loaded=loaded, progress=False, kv_cache_dtype="int8", **ENGINE_KW)
    batched = [o.outputs[0].token_ids for o in eng.generate(prompts, SHORT)]
    alone = [eng.generate([p], SHORT)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    f32 = Engine(loaded=loaded, progress=False, **ENGINE_KW)
    assert batched == [o.outputs[0].token_ids for o in f32.generate(prompts, SHORT)]
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]


@pytest.mark.parametrize("change, field", [
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                           "sliding_attention": {"rope_type": "default"}}), "rope_scaling.rope_type"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "rope_parameters.sliding_attention.rope_type"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types"),
    (dict(hidden_activation="xielu"), "hidden_act"),
])
def test_unsupported_config_is_refused_naming_the_field(change, field):
    d = hf_config_dict()
    d.update(change)
    with pytest.raises(ValueError, match=f"^{field}:"):
        config_from_hf(d)


def test_tensor_parallel_is_refused_naming_the_family(tiny):
    from types import SimpleNamespace
    from unittest import mock

    _, loaded, _ = tiny
    from jaxinfer import sharding
    from jaxinfer.models.base import flat_params

    with mock.patch.object(sharding, "tp_size", lambda mesh: 2):
        with pytest.raises(ValueError, match="^tensor_parallel_size: Gemma3ForCausalLM"):
            build_model(loaded.config, flat_params(loaded.model), np.float32, SimpleNamespace())

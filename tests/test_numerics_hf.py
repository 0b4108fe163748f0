"""Our model vs HF transformers (torch CPU, float32) on tiny random-weight models built
from configs (no download): logits within 1e-4 relative, greedy 32 tokens identical,
and the same through an HF checkpoint directory on disk."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips

from jaxinfer.models.registry import config_from_hf  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.loading import hf_tensors_to_flat  # noqa: E402
from jaxinfer.models.registry import params_from_flat  # noqa: E402
from jaxinfer.reference import ReferenceGenerator  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    "llama3-rope-tied-mqa": ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE,
                                                  "tie_word_embeddings": True,
                                                  "num_key_value_heads": 1}),
    "llama-attn-bias": ("LlamaForCausalLM", {"attention_bias": True}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 12}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
}


@pytest.fixture(scope="module")
def default_tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer files (from its GGUF), for an HF-dir test."""
    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import load_gguf

    out = tmp_path_factory.mktemp("tok")
    load_gguf(default_model_path()).tokenizer.hf.save_pretrained(str(out))
    return out


def tiny_hf_model(arch: str, **overrides):
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    base.update(overrides)
    hf_cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**base)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(hf_cfg).eval().float()
    # Random init leaves biases / norms at 0 / 1; perturb every tensor so each is tested.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    d = hf_cfg.to_dict()
    d["architectures"] = [arch]
    return d, model


def ours_from_torch(d, model, dtype="float32"):
    cfg = config_from_hf(d)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return params_from_flat(cfg, hf_tensors_to_flat(cfg, sd))


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf(case):
    arch, overrides = CASES[case]
    d, hf = tiny_hf_model(arch, **overrides)
    ours = ours_from_torch(d, hf)
    gen = ReferenceGenerator(ours)
    ids = np.random.RandomState(1).randint(3, d["vocab_size"], size=48).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    # The engine's path (paged attention, batch-invariant matmuls) and an independent
    # dense-attention path with XLA's own matmuls.
    for g in (gen, ReferenceGenerator(ours, attention="dense", batch_invariant=False)):
        got = g.logits(ids)
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, f"{case}: max relative logit error {rel:.2e}"

    want = hf_greedy(hf, ids[:20], 32)
    res = gen.generate([ids[:20]], [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)], [0])
    assert res[0].token_ids == want


def test_sliding_window_is_exercised():
    """The window must change the logits, or the Mistral case above tests nothing."""
    d, hf = tiny_hf_model("MistralForCausalLM", sliding_window=12)
    ours = ours_from_torch(d, hf)
    d2 = dict(d, sliding_window=None)
    ours_nowin = ours_from_torch(d2, hf)
    ids = list(range(3, 43))
    a = ReferenceGenerator(ours).logits(ids)
    b = ReferenceGenerator(ours_nowin).logits(ids)
    assert np.abs(a[:12] - b[:12]).max() < 1e-6       # inside the window: identical
    assert np.abs(a[20:] - b[20:]).max() > 1e-3       # beyond it: different


def test_padded_batch_equals_single_rows():
    d, hf = tiny_hf_model("LlamaForCausalLM")
    gen = ReferenceGenerator(ours_from_torch(d, hf))
    rng = np.random.RandomState(2)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (5, 17, 33)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = gen.generate(prompts, [p] * 3, [0, 0, 0])
    for prompt, row in zip(prompts, batch):
        assert gen.generate([prompt], [p], [0])[0].token_ids == row.token_ids
        assert row.token_ids == hf_greedy(hf, prompt, 12)


def test_hf_checkpoint_directory_roundtrip(tmp_path, default_tokenizer_dir):
    """config.json + sharded safetensors + index + tokenizer files, loaded by load_model."""
    from safetensors.torch import save_file

    from jaxinfer.loading import load_model

    d, hf = tiny_hf_model("Qwen2ForCausalLM", vocab_size=49152, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    for f in os.listdir(default_tokenizer_dir):
        (tmp_path / f).write_bytes((default_tokenizer_dir / f).read_bytes())
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "Qwen2ForCausalLM"
    assert loaded.generation_config == {"temperature": 0.7}
    ids = list(range(5, 25))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = ReferenceGenerator(loaded.model).logits(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4

    # A shape mismatch names the tensor and both shapes.
    bad = dict(d, intermediate_size=80)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*\(64, 32\).*\(80, 32\)|"
                                         r"mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_model(str(tmp_path))

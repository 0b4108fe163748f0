"""The GPT-style families (models/gpt.py) against HF transformers: GPT-2, GPT-NeoX, OPT,
BLOOM, Falcon, GPTBigCode and MPT.

Each case is a tiny random-weight transformers model built from a config (no download),
saved with ``save_pretrained`` (safetensors) next to a byte-level tokenizer.json, and loaded
by ``load_model`` like any checkpoint directory. Checked here: logits within 1e-4 (float32)
of transformers' on several prompts, for each family and the variants that take another
path through the shared layer; int8 / int4 weights and int8 KV pages run and stay close to
float; tensor parallelism 2 (fake CPU devices, a subprocess) gives transformers' greedy
tokens; unsupported config fields are refused naming the field. The engine itself (paged,
batched with sampled neighbours, chunked prefill and preemption forced, no compile after
warm-up) is compared with transformers' generate for one config of each family in
tests/test_hf_oracle.py (its FAMILIES list).
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
from tp_worker import run_on_fake_devices  # noqa: E402

V, NPOS = 256, 128
_T = dict(vocab_size=V, bos_token_id=1, eos_token_id=2)
# name -> (HF class, its config class, config fields). The first seven: one per family (also
# under quantization and TP); the rest are variants that take another path of the layer.
CASES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=NPOS)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      rotary_pct=0.5, max_position_embeddings=NPOS)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                ffn_dim=128, max_position_embeddings=NPOS)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconForCausalLM", "FalconConfig",
               dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, max_position_embeddings=NPOS)),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                    dict(n_embd=64, n_layer=2, n_head=4, n_positions=NPOS)),
    "mpt": ("MptForCausalLM", "MptConfig", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=NPOS)),
    # variants
    "gpt_neox-sequential": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, use_parallel_residual=False)),
    "opt-postnorm-project": ("OPTForCausalLM", "OPTConfig",
                             dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                  max_position_embeddings=NPOS, do_layer_norm_before=False,
                                  word_embed_proj_dim=32)),
    "falcon-7b-style-mqa": ("FalconForCausalLM", "FalconConfig",
                            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "falcon-sequential-bias": ("FalconForCausalLM", "FalconConfig",
                               dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    multi_query=False, parallel_attn=False, bias=True)),
    "gpt_bigcode-mha": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                        dict(n_embd=64, n_layer=2, n_head=4, n_positions=NPOS, multi_query=False)),
    "bloom-12-heads": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=96, n_layer=2, n_head=12)),
    "mpt-6-heads-clip": ("MptForCausalLM", "MptConfig",
                         dict(d_model=96, n_layers=2, n_heads=6, max_seq_len=NPOS,
                              attn_config=dict(clip_qkv=0.3))),
    # transformers builds the MLP 4 x d_model whatever expansion_ratio says: so do we
    "mpt-expansion-ratio-2": ("MptForCausalLM", "MptConfig",
                              dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=NPOS, expansion_ratio=2)),
}
FAMILIES = list(CASES)[:7]
PROMPTS = [np.random.RandomState(i).randint(3, V, size=n).tolist() for i, n in enumerate((3, 17, 45, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The TP engine's small ladders (few compiles): 4 decode slots; prefill in 2 x 16-position
# slots, so the 45- and 70-token prompts are cut into chunks over several steps.
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=NPOS, num_pages=40,
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(4,), prefill_buckets=((2, 16),),
                 page_buckets=(8,))


def byte_tokenizer():
    """A 256-token byte-level BPE tokenizer without merges (ids are bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    b2u = {b: chr(b) for b in keep}
    b2u.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in b2u)})
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=b2u[2], bos_token=b2u[1])


def build_hf(case: str):
    arch, cfg_cls, fields = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**_T, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval().float()
    # Random init leaves biases / norms at 0 / 1; perturb every tensor so each is tested.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


_DIRS: dict[str, tuple[str, object]] = {}


def hf_checkpoint(case: str, root: pathlib.Path):
    """(checkpoint dir, the HF model), built once per case in this process."""
    if case not in _DIRS:
        model = build_hf(case)
        path = root / case
        model.save_pretrained(str(path), safe_serialization=True)
        byte_tokenizer().save_pretrained(str(path))
        _DIRS[case] = (str(path), model)
    return _DIRS[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpt_families")


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


TAIL = 16   # logits compared at each prompt's last TAIL positions (one compiled shape for all)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case, root):
    """The engine's forward (paged attention, its matmuls: quality.tail_logits) on three
    prompts, against transformers, from the checkpoint directory."""
    from jaxinfer.loading import load_model
    from jaxinfer.quality import tail_logits

    path, hf = hf_checkpoint(case, root)
    loaded = load_model(path)
    assert loaded.config.gpt is not None and loaded.config.architecture == CASES[case][0]
    for ids in PROMPTS[1:]:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -TAIL:].numpy()
        err = rel_err(tail_logits(loaded.model, ids, TAIL), want)
        assert err < 1e-4, f"{case}: prompt of {len(ids)} tokens, relative logit error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_weights_and_int8_kv_stay_close(family, root):
    """int8 / int4 weights (the CPU kernels' fused layout included) and int8 KV pages run
    for every family; logits stay near float32's and do change (the option is applied)."""
    from jaxinfer.loading import load_model
    from jaxinfer.quality import tail_logits
    from jaxinfer.quantization import quantize_model

    loaded = load_model(hf_checkpoint(family, root)[0])
    ids = PROMPTS[3]
    base = tail_logits(loaded.model, ids, TAIL)
    # Max-abs relative error against float32 (random Gaussian weights quantize worse than
    # trained ones): int8 stays well under 0.05; int4 (group 64) lands near 0.2-0.25. A
    # wrongly laid out weight (a q/k/v split off by a head) gives errors of order 1.
    for what, mode, tol in (("int8 weights + int8 KV", "int8", 0.05), ("int4 weights", "int4", 0.35)):
        got = tail_logits(quantize_model(loaded.model, mode), ids, TAIL, kv_int8=mode == "int8")
        err = rel_err(got, base)
        assert 0 < err < tol, f"{family} {what}: relative logit error {err:.2e}"


def test_tensor_parallel_2_matches_hf(root):
    """tp=2 on two fake CPU devices (a subprocess: the device count is fixed at start-up):
    every family's greedy tokens equal transformers' (MQA KV heads repeated, ALiBi slopes
    split with their heads, vocabulary-parallel embedding and head)."""
    dirs = {f: hf_checkpoint(f, root)[0] for f in FAMILIES}
    want = {f: [hf_greedy(hf_checkpoint(f, root)[1], p, 8) for p in PROMPTS] for f in FAMILIES}
    got = run_on_fake_devices(__file__, dirs, devices=2)
    for f in FAMILIES:
        assert got[f] == want[f], f"{f}: tp=2 tokens differ from transformers'"


def test_unsupported_config_fields_are_refused():
    def cfg(arch, **d):
        return config_from_hf({"architectures": [arch], "vocab_size": V, **d})

    gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=NPOS)
    with pytest.raises(ValueError, match="activation_function: .*unsupported activation 'swish'"):
        cfg("GPT2LMHeadModel", activation_function="swish", **gpt2)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        cfg("GPT2LMHeadModel", scale_attn_by_inverse_layer_idx=True, **gpt2)
    neox = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    with pytest.raises(ValueError, match="rope_scaling: .*'dynamic'"):
        cfg("GPTNeoXForCausalLM", rope_scaling={"type": "dynamic", "factor": 2.0}, **neox)
    falcon = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="alibi: .*falcon-rw"):
        cfg("FalconForCausalLM", alibi=True, **falcon)
    with pytest.raises(ValueError, match="parallel_attn"):
        cfg("FalconForCausalLM", new_decoder_architecture=True, parallel_attn=False, **falcon)
    mpt = dict(d_model=64, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match="qk_ln"):
        cfg("MptForCausalLM", attn_config={"qk_ln": True}, **mpt)
    with pytest.raises(ValueError, match="no_bias"):
        cfg("MptForCausalLM", no_bias=False, **mpt)
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        cfg("BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4,
            apply_residual_connection_post_layernorm=True)
    with pytest.raises(ValueError, match="n_head: missing from config.json"):
        cfg("GPT2LMHeadModel", n_embd=64, n_layer=2)
    with pytest.raises(ValueError, match="unsupported architecture 'RwkvForCausalLM'.*BloomForCausalLM"):
        cfg("RwkvForCausalLM")


def test_alibi_and_clip_are_exercised():
    """ALiBi and clip_qkv must change the logits, or the cases above test nothing."""
    import dataclasses

    from jaxinfer.loading import hf_tensors_to_flat
    from jaxinfer.models.registry import params_from_flat
    from jaxinfer.quality import tail_logits

    for case, field, value in (("bloom", "positions", "none"), ("mpt-6-heads-clip", "clip_qkv", None)):
        hf = build_hf(case)
        d = dict(hf.config.to_dict(), architectures=[CASES[case][0]])
        cfg = config_from_hf(d)
        flat = hf_tensors_to_flat(cfg, {k: v.detach().numpy() for k, v in hf.state_dict().items()})
        # the same weights without the ALiBi bias / without the clamp
        cfg2 = dataclasses.replace(cfg, gpt=dataclasses.replace(cfg.gpt, **{field: value}))
        a = tail_logits(params_from_flat(cfg, flat), PROMPTS[2], TAIL)
        b = tail_logits(params_from_flat(cfg2, flat), PROMPTS[2], TAIL)
        assert np.abs(a - b).max() > 1e-3, case


def _tp_worker(dirs: dict[str, str]) -> None:
    """Subprocess body of test_tensor_parallel_2_matches_hf: prints {family: tokens}."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    out = {}
    kw = dict(ENGINE_KW, tensor_parallel_size=2)
    for family, path in dirs.items():
        eng = Engine(loaded=load_model(path), progress=False, **kw)
        res = eng.generate(PROMPTS, GREEDY)
        out[family] = [r.outputs[0].token_ids for r in res]
    print(json.dumps(out))


if __name__ == "__main__":
    _tp_worker(json.loads(sys.argv[1]))

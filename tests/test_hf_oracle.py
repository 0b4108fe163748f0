"""The continuous-batching ``Engine`` against HF transformers, directly.

The other oracles go through ``ReferenceGenerator``, which shares the model, sampler,
attention and matmuls with the engine, so an error common to both would pass there. Here
every request runs through the real engine (paged KV cache, requests arriving while others
run, chunked prefill and preemption forced by a small token budget and KV pool, greedy
rows batched with sampled neighbours) and is compared with HF (float32) on the same
weights: the greedy tokens must be HF's greedy choice at every position (HF's logits for
the whole continuation in one forward, tests/hf_greedy.py) and the chosen tokens' logprobs
and the top alternatives close to HF's log-softmax of those logits.

Models: the default model (SmolLM2 GGUF, read by transformers' own GGUF reader as in
tests/test_default_model.py) and tiny random-weight models of each supported family, built
from an HF config and saved as safetensors + a tokenizer in a tmp dir, loaded by
``load_model`` like a user's checkpoint. To cover a new family, append a ``Family`` to
``FAMILIES`` (its HF config class and the overrides that exercise its features).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest

import torch
import transformers

from hf_greedy import teacher_forced_logits  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402

# Tolerances on log-probabilities (float32 both sides, |logprob| of a few units): the
# engine and HF differ only in float32 summation order.
LOGPROB_ATOL = 2e-4
TOP_LOGPROBS = 4


# ----------------------------------------------------------------------------- families

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Family:
    """One tiny random-weight model: ``config()`` returns the HF config to build it from
    (``AutoModelForCausalLM.from_config``); its weights are perturbed so that no bias is 0
    and no norm weight 1, then saved as a safetensors checkpoint."""

    name: str
    config: Callable[[], Any]


def _cfg(cls_name: str, **overrides: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, cls_name)(**{**TINY, **overrides})


FAMILIES: list[Family] = [
    Family("llama", _cfg("LlamaConfig")),
    Family("llama3-rope-tied-bias", _cfg("LlamaConfig", tie_word_embeddings=True, attention_bias=True,
                                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32})),
    Family("mistral-window", _cfg("MistralConfig", sliding_window=24)),
    Family("qwen2", _cfg("Qwen2Config")),
    Family("qwen3", _cfg("Qwen3Config", head_dim=32)),
]
# Phi-3: fused checkpoint tensors, a sliding window shorter than the longer prompts, rotary
# on half of each head, longrope in its short regime (original_max_position_embeddings is
# the engine's max_model_len; the long regime: tests/test_phi3.py).
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0],
                 "long_factor": [2.0, 3.0, 5.0, 8.0]}
FAMILIES += [
    Family("phi3-longrope-window-partial", _cfg("Phi3Config", sliding_window=24, partial_rotary_factor=0.5,
                                                original_max_position_embeddings=128, pad_token_id=0,
                                                rope_scaling=PHI3_LONGROPE)),
]
# Gemma 3: sliding (window 24) and global layers with their own rope bases (linear scaling
# on the global ones), q/k norms, (1 + w) norms, scaled embeddings, final soft-capping.
FAMILIES += [
    Family("gemma3-sliding-global", _cfg(
        "Gemma3TextConfig", head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=8.0, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
]
# Mixture of experts (models/mixtral.py): Mixtral with a sliding window, top-2 of 8 experts;
# Qwen3-MoE with top-3 of 8 renormalized, q/k norms and a dense layer (mlp_only_layers).
# Tensor parallelism and Qwen2-MoE's shared expert: tests/test_moe.py.
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=24)
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, head_dim=32,
                 norm_topk_prob=True, mlp_only_layers=[1])
FAMILIES += [
    Family("mixtral-window", _cfg("MixtralConfig", **MIXTRAL)),
    Family("qwen3-moe", _cfg("Qwen3MoeConfig", **QWEN3_MOE)),
]
# The GPT-style families (models/gpt.py), each with its own config field names; the
# variants of each (post-norm OPT, old Falcon, multi-head BigCode, ...) are checked against
# HF's logits in tests/test_gpt_families.py.
_GPT = dict(vocab_size=TINY["vocab_size"], bos_token_id=1, eos_token_id=2)
FAMILIES += [
    Family("gpt2", lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **_GPT)),
    Family("gpt-neox-partial-rotary", lambda: transformers.GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        rotary_pct=0.5, max_position_embeddings=256, **_GPT)),
    Family("opt", lambda: transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 ffn_dim=128, max_position_embeddings=256, **_GPT)),
    Family("bloom-alibi", lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **_GPT)),
    Family("falcon-new-arch-gqa", lambda: transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, max_position_embeddings=256, **_GPT)),
    Family("gpt-bigcode-mqa", lambda: transformers.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4,
                                                                   n_positions=256, **_GPT)),
    Family("mpt-alibi", lambda: transformers.MptConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=256,
                                                       **_GPT)),
]


# ----------------------------------------------------------------------------- helpers

def tiny_tokenizer_files(out_dir: str) -> None:
    """A byte-level BPE tokenizer without merges (256 byte tokens + <s>, </s>), written
    as tokenizer.json: the engine needs one to detokenize; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)


def build_family(family: Family, out_dir: str):
    """-> (HF model in float32, eval mode), after saving it + a tokenizer to ``out_dir``."""
    torch.manual_seed(0)
    cfg = family.config()
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny_tokenizer_files(out_dir)
    return model


def hf_greedy_logprobs(model, ids: list[int], ours: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy choice and log-softmax (float64 of its float32 logits) at each
    position of the engine's continuation ``ours``, in one forward (tests/hf_greedy.py):
    where the choices equal ``ours``, they are transformers' greedy continuation."""
    logits = torch.from_numpy(teacher_forced_logits(model, ids, ours)).double()
    return logits.argmax(-1).tolist(), torch.log_softmax(logits, -1).numpy()


@dataclasses.dataclass
class Run:
    outputs: dict[str, Any]        # request id -> final RequestOutput
    preemptions: int
    max_prefill_chunks: int        # prefill pieces in one step (>1: prompts packed / chunked)
    free_pages_ok: bool
    compiles: int = 0              # XLA compiles during the run (after the engine's warm-up)


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: list[int], seed: int) -> Run:
    """Greedy requests ``g{i}`` (logprobs on) interleaved with sampled neighbours ``s{i}``,
    added a few at a time between steps, until all finish."""
    rng = np.random.RandomState(seed)
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        reqs.append((f"g{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                logprobs=TOP_LOGPROBS)))
        if i % 2 == 0:      # a sampled neighbour with its own length
            reqs.append((f"s{i}", p[: max(1, len(p) // 2)],
                         SamplingParams(temperature=0.9, top_p=0.9, max_tokens=n, seed=i, ignore_eos=True)))
    dispatch, chunks = engine.runner.dispatch, [0]

    def counting_dispatch(batch, *rest):
        chunks.append(sum(e.num_new_tokens > 1 for _, e in batch.entries))
        return dispatch(batch, *rest)

    engine.runner.dispatch = counting_dispatch
    pre0 = engine.stats()["num_preemptions_total"]
    from test_engine import COMPILES

    COMPILES.count, COMPILES.active = 0, True
    try:
        outs, i = {}, 0
        while i < len(reqs) or engine.has_unfinished():
            for _ in range(int(rng.randint(0, 3))):
                if i < len(reqs):
                    rid, p, sp = reqs[i]
                    engine.add_request(p, sp, request_id=rid)
                    i += 1
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
    finally:
        del engine.runner.dispatch
        COMPILES.active = False
    st = engine.stats()
    return Run(outs, st["num_preemptions_total"] - pre0, max(chunks),
               st["num_free_pages"] == st["num_total_pages"], COMPILES.count)


def compare_with_hf(hf_model, run: Run, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
    """Every greedy request's tokens, chosen logprobs and top alternatives vs HF -> a list
    of differences (empty when the engine agrees)."""
    errors = []
    for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
        out = run.outputs[f"g{i}"].outputs[0]
        assert len(out.token_ids) == n
        want, lsm = hf_greedy_logprobs(hf_model, ids, out.token_ids)
        if out.token_ids != want:
            k = next((j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b), len(want))
            errors.append(f"request {i} (prompt {len(ids)} tokens): tokens differ from HF at "
                          f"position {k}: {out.token_ids[k:k + 4]} vs {want[k:k + 4]}")
            continue
        for j, (tok, lp) in enumerate(zip(want, out.logprobs)):
            err = abs(lp.logprob - lsm[j, tok])
            if not err <= LOGPROB_ATOL:
                errors.append(f"request {i} position {j}: logprob {lp.logprob:.6f} vs HF "
                              f"{lsm[j, tok]:.6f}")
                break
            ours_ids = [t for t, _ in lp.top]
            hf_ids = np.argsort(-lsm[j], kind="stable")[:TOP_LOGPROBS].tolist()
            gaps = np.diff(np.sort(lsm[j])[::-1][:TOP_LOGPROBS + 1])
            # Ranks may only swap where HF itself has a near-tie.
            if ours_ids != hf_ids and np.abs(gaps).min() > 10 * LOGPROB_ATOL:
                errors.append(f"request {i} position {j}: top ids {ours_ids} vs HF {hf_ids}")
                break
            top_err = max(abs(x - lsm[j, t]) for t, x in lp.top)
            if not top_err <= LOGPROB_ATOL:
                errors.append(f"request {i} position {j}: top logprobs off by {top_err:.2e}")
                break
    return errors


def alone_vs_batched(engine: Engine, run: Run, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
    """Each greedy request run again alone: its tokens, chosen logprobs and top
    alternatives must be the same bits as in the batched run (batch invariance) -> a list
    of differences."""
    errors = []
    for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_LOGPROBS)
        alone = engine.generate([ids], sp)[0].outputs[0]
        batched = run.outputs[f"g{i}"].outputs[0]
        got = [(lp.token_id, lp.logprob, lp.top) for lp in batched.logprobs]
        want = [(lp.token_id, lp.logprob, lp.top) for lp in alone.logprobs]
        if batched.token_ids != alone.token_ids or got != want:
            k = next(j for j, (a, b) in enumerate(zip(got + [None], want + [0])) if a != b)
            errors.append(f"request {i}: batched differs from alone at position {k}: "
                          f"{got[k:k + 1]} vs {want[k:k + 1]}")
    return errors


def check_run(run: Run, n_prompts: int) -> None:
    assert len(run.outputs) >= n_prompts
    assert run.preemptions > 0, "the test meant to force preemption (KV pool too small)"
    assert run.max_prefill_chunks >= 2, "the test meant steps with several prefill pieces"
    assert run.free_pages_ok, "leaked KV pages"
    assert run.compiles == 0, f"{run.compiles} XLA compiles after the engine's warm-up"


# ----------------------------------------------------------------------------- tiny families

# Small and few shapes: 4 rows, a 32-token step budget cut into two 16-position prefill
# slots (prompts longer than 32 are chunked over steps), 12 pages of 16 tokens for
# requests needing ~30 (preemption), pages per sequence up to 8 (128 tokens).
TINY_ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=12,
                      page_buckets=(8,), min_sampler_rows=16, decode_buckets=(1, 4), mixed_decode_buckets=(0, 4),
                      prefill_buckets=((2, 16),))
TINY_PROMPT_LENS = (5, 23, 40, 61, 9, 33)
TINY_MAX_TOKENS = (20, 12, 24, 16, 32, 8)    # one request of 32 greedy tokens per family


def tiny_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(1)
    return [rng.randint(3, vocab, size=n).tolist() for n in TINY_PROMPT_LENS]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family_models(request, tmp_path_factory):
    """(family, HF model, Engine on the same weights loaded from the saved checkpoint)."""
    fam = request.param
    out = tmp_path_factory.mktemp(fam.name)
    hf = build_family(fam, str(out))
    engine = Engine(loaded=load_model(str(out), "float32"), progress=False, **TINY_ENGINE_KW)
    return fam, hf, engine


def test_engine_matches_hf_on_tiny_family(family_models):
    fam, hf, engine = family_models
    prompts = tiny_prompts(hf.config.vocab_size)
    run = run_engine(engine, prompts, list(TINY_MAX_TOKENS), seed=0)
    check_run(run, len(prompts))
    errors = compare_with_hf(hf, run, prompts, list(TINY_MAX_TOKENS))
    assert not errors, f"{fam.name}: engine differs from HF transformers:\n" + "\n".join(errors)
    errors = alone_vs_batched(engine, run, prompts, list(TINY_MAX_TOKENS))
    assert not errors, f"{fam.name}: logprobs not bitwise batch-invariant:\n" + "\n".join(errors)


def test_oracle_catches_an_engine_change(tmp_path, monkeypatch):
    """The comparison must fail when the engine computes something slightly different:
    the tiny Llama with the engine's RMSNorm epsilon raised from 1e-5 to 1e-3 (a change in
    jaxinfer's layers only; HF keeps its own)."""
    from jaxinfer.models import layers

    hf = build_family(FAMILIES[0], str(tmp_path))
    rms_norm = layers.rms_norm
    monkeypatch.setattr(layers, "rms_norm", lambda x, w, eps: rms_norm(x, w, eps * 100))
    engine = Engine(loaded=load_model(str(tmp_path), "float32"), progress=False, **TINY_ENGINE_KW)
    prompts = tiny_prompts(hf.config.vocab_size)
    run = run_engine(engine, prompts, list(TINY_MAX_TOKENS), seed=0)
    errors = compare_with_hf(hf, run, prompts, list(TINY_MAX_TOKENS))
    assert errors, "a changed RMSNorm epsilon went unnoticed by the HF comparison"


# ----------------------------------------------------------------------------- default model

@pytest.mark.slow
def test_engine_matches_hf_on_default_model():
    # The prompts and HF model of tests/test_default_model.py, the engine shapes of
    # tests/test_engine.py (the run's compilation cache serves both): 48 pages of 16
    # tokens for prompts needing ~80 (preemption).
    from test_default_model import CHATS, RAW, hf_default_model
    from test_engine import DEFAULT_MODEL_ENGINE_KW

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in CHATS]
    prompts += [tok.encode(t)[:300] for t in RAW]        # the long one cut to fit 512
    long = tok.encode(RAW[2])
    prompts += [long[-280:], long[120:380]]             # three long prompts: preemption
    max_tokens = [24, 16, 20, 12, 24, 16, 12, 20, 16, 20]
    hf = hf_default_model()

    engine = Engine(loaded=loaded, progress=False, **DEFAULT_MODEL_ENGINE_KW)
    # The GGUF's Q4_1 layers and Q8_0 head run as their exact codes (EngineConfig.weight_codes,
    # pallas_kernels/f32_matmul/codes.py), HF on the dequantized floats: the same tokens.
    from pallas_kernels.f32_matmul.cpu import CodedF32

    model = engine.loaded.model
    assert all(isinstance(getattr(layer, n).get_value(), CodedF32) for layer in model.layers
               for n in ("wqkv", "wo", "w_gate_up", "w_down")) and isinstance(model.lm_head.get_value(), CodedF32)
    run = run_engine(engine, prompts, max_tokens, seed=0)
    check_run(run, len(prompts))
    errors = compare_with_hf(hf, run, prompts, max_tokens)
    assert not errors, "default model: engine differs from HF transformers:\n" + "\n".join(errors)


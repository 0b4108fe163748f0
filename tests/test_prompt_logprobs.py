"""Prompt logprobs (SamplingParams.prompt_logprobs, engine/scoring.py) against HF
transformers: every prompt token's log-probability and top-k alternatives within 1e-4 of
HF's float32 log-softmax, on tiny random models and the default model; chunked prefill
forced (a 24-token budget cuts each prompt over several steps and 8-position slots cut
each chunk in pieces); the same bits alone and batched with other requests; scoring-only
requests (max_tokens 0) and ordinary ones; prefix-cache hits recomputed; no compile once
warm and no page left held.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch
import transformers

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from test_engine import COMPILES  # noqa: E402
from test_hf_oracle import FAMILIES, build_family  # noqa: E402

ATOL = 1e-4
K = 5
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128, num_pages=40,
                 page_size=8, min_sampler_rows=16, decode_buckets=(1, 4), mixed_decode_buckets=(0, 4),
                 prefill_buckets=((1, 8), (4, 8)), page_buckets=(16,), enable_prompt_logprobs=True)
TINY_FAMILIES = [f for f in FAMILIES if f.name in ("llama", "gpt2")]


def hf_prompt_logprobs(model, ids: list[int]) -> np.ndarray:
    """log-softmax (float64 of HF's float32 logits) at every position: [L, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def check_against_hf(lsm: np.ndarray, ids: list[int], plp: list, k: int) -> list[str]:
    """Our entries vs HF's log-softmax; returns the differences (empty: all within ATOL)."""
    errs = []
    if len(plp) != len(ids) or plp[0] is not None:
        return [f"{len(plp)} entries for {len(ids)} prompt tokens, first {plp[0]!r}"]
    for i in range(1, len(ids)):
        e, row = plp[i], lsm[i - 1]
        if e.token_id != ids[i] or abs(e.logprob - row[ids[i]]) > ATOL:
            errs.append(f"pos {i}: token {e.token_id} lp {e.logprob:.6f}, HF {ids[i]} {row[ids[i]]:.6f}")
        kth = np.sort(row)[-k]
        if len(e.top) != k:
            errs.append(f"pos {i}: {len(e.top)} alternatives, want {k}")
        for tid, v in e.top:        # each is HF's value, and among HF's top k (ties within ATOL)
            if abs(v - row[tid]) > ATOL or v < kth - ATOL:
                errs.append(f"pos {i}: top {tid} {v:.6f}, HF {row[tid]:.6f} (k-th {kth:.6f})")
    return errs


def prompts_for(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1] + rng.integers(3, vocab, n).tolist() for n in (37, 20, 51, 9)]


@pytest.fixture(scope="module", params=TINY_FAMILIES, ids=lambda f: f.name)
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param.name))
    hf = build_family(request.param, path)
    eng = Engine(loaded=load_model(path, "float32"), progress=False, **ENGINE_KW)
    return hf, eng


def test_tiny_models_match_hf_alone_batched_and_scoring_only(tiny):
    hf, eng = tiny
    prompts = prompts_for(hf.config.vocab_size)
    sp = SamplingParams(max_tokens=0, prompt_logprobs=K)
    alone = [eng.generate([p], sp)[0] for p in prompts]
    assert eng.is_warm
    COMPILES.active = True
    try:
        # batched: scoring-only, scoring + generation, and plain requests side by side
        mixed = [sp, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K),
                 SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=4, prompt_logprobs=K, seed=1)]
        batched = eng.generate(prompts, mixed)
    finally:
        COMPILES.active = False
    assert COMPILES.count == 0, f"{COMPILES.count} compiles after warm-up"
    errors = []
    for p, a, b, params in zip(prompts, alone, batched, mixed):
        assert a.outputs[0].token_ids == [] and a.outputs[0].finish_reason == "length"
        errors += check_against_hf(hf_prompt_logprobs(hf, p), p, a.prompt_logprobs, K)
        if params.prompt_logprobs is None:
            assert b.prompt_logprobs is None
            continue
        assert b.prompt_logprobs == a.prompt_logprobs, "prompt logprobs differ alone and batched"
        assert len(b.outputs[0].token_ids) == params.max_tokens
    assert not errors, "\n".join(errors[:20])
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages


def test_cache_hits_are_recomputed_and_siblings_share(tiny):
    hf, eng = tiny
    p = prompts_for(hf.config.vocab_size)[2]
    eng.generate([p], SamplingParams(max_tokens=2, temperature=0))        # caches its pages
    hits = eng.stats()["prefix_cache_hits_total"]
    two = eng.generate([p], SamplingParams(n=2, max_tokens=2, temperature=0.8, seed=3, prompt_logprobs=2))[0]
    # the counter also counts the second sample sharing the first one's full prompt pages;
    # a cache hit would add the first sample's pages too
    shared = (len(p) - 1) // eng.config.page_size * eng.config.page_size
    assert eng.stats()["prefix_cache_hits_total"] - hits == shared, "a prompt-logprobs request used a cache hit"
    assert not check_against_hf(hf_prompt_logprobs(hf, p), p, two.prompt_logprobs, 2)
    assert len(two.outputs) == 2


def test_refused_without_scoring_buckets():
    from jaxinfer.engine.batch import BucketLadders
    lad = BucketLadders((1,), (0,), ((1, 8),), (4,))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        lad.choose(0, [8], 2, score=True)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.slow
def test_default_model_matches_hf_chunked_and_batched():
    from test_default_model import hf_default_model

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    texts = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
             "Question: Which is heavier, a kilogram of feathers or a kilogram of steel? Answer:"]
    prompts = [tok.encode(t) for t in texts]
    hf = hf_default_model()
    # lazy warm-up: only the step shapes this test runs are compiled (no compile-count
    # assertion here; the tiny-model test above makes it)
    kw = dict(ENGINE_KW, max_model_len=256, num_pages=48, warmup="lazy")
    eng = Engine(loaded=loaded, progress=False, **kw)
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=K)
    batched = eng.generate(prompts, sp)
    alone = eng.generate([prompts[1]], sp)[0]
    assert alone.prompt_logprobs == batched[1].prompt_logprobs
    errors = []
    for p, out in zip(prompts, batched):
        errors += check_against_hf(hf_prompt_logprobs(hf, p), p, out.prompt_logprobs, K)
    assert not errors, "\n".join(errors[:20])

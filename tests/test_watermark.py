"""Watermark (jaxinfer/engine/watermark.py): the green-list hash, the z-test, the sampler's
bias on device, and the host detector agreeing with the device's green lists.

The engine-level check (200 texts of 128 tokens from the default model, watermarked vs
not) is benchmarks/watermark.py; its figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxinfer.sampling_params import SamplingParams as SP
from jaxinfer.engine import sampler as S
from jaxinfer.engine import watermark as W

M32 = 0xFFFFFFFF


def _fmix32_by_hand(h: int) -> int:
    """murmur3's finalizer on plain Python ints (independent of the module's array code)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_green_list_hand_computed_case():
    # prev = 3: seed = fmix32(3 * 15485863 mod 2^32); token v: fmix32(seed ^ (v * 0x9E3779B1))
    seed = _fmix32_by_hand((3 * 15485863) & M32)
    assert 3 * 15485863 == 46457589
    hashes = [_fmix32_by_hand(seed ^ ((v * 0x9E3779B1) & M32)) for v in range(8)]
    want = [h < 2**31 for h in hashes]                  # gamma = 0.5: threshold 2^31
    got = W.is_green([3] * 8, range(8), gamma=0.5)
    assert got.tolist() == want
    assert 0 < sum(want) < 8                            # the case has both colours
    # gamma = 0.25 keeps exactly the hashes below 2^30
    assert W.is_green([3] * 8, range(8), gamma=0.25).tolist() == [h < 2**30 for h in hashes]
    assert W.Watermark(gamma=0.25).threshold == 2**30


def test_z_score_hand_computed_case():
    # 12 green of 16 at gamma 0.5: z = (12 - 8) / sqrt(16 * 0.25) = 2; p = 1 - Phi(2)
    assert W.z_score(12, 16, 0.5) == pytest.approx(2.0)
    assert W.p_value(2.0) == pytest.approx(0.0227501319, rel=1e-8)
    # a sequence built to be 12/16 green: detect() must find exactly that
    rng = np.random.default_rng(0)
    ids = [int(rng.integers(1000))]
    while len(ids) < 17:
        want_green = len(ids) <= 12
        t = int(rng.integers(1000))
        if bool(W.is_green([ids[-1]], [t], 0.5)[0]) == want_green and (ids[-1], t) not in zip(ids, ids[1:]):
            ids.append(t)
    d = W.detect(ids, 0.5)
    assert (d.num_green, d.num_scored) == (12, 16)
    assert d.z_score == pytest.approx(2.0) and d.p_value == pytest.approx(0.0227501319, rel=1e-8)


def test_detect_ignores_repeated_bigrams_and_checks_input():
    ids = [5, 9] * 20
    assert W.detect(ids).num_scored == 2
    assert W.detect(ids, ignore_repeated_bigrams=False).num_scored == 39
    with pytest.raises(ValueError, match="token_ids"):
        W.detect([4])
    with pytest.raises(ValueError, match="watermark.gamma"):
        SP(watermark={"gamma": 1.0})
    with pytest.raises(ValueError, match="watermark.delta"):
        SP(watermark={"delta": -1})
    with pytest.raises(ValueError, match="unknown field"):
        SP(watermark={"gama": 0.5})
    assert SP(watermark=True).watermark == W.Watermark() and SP(watermark=False).watermark is None


def test_green_fraction_of_random_vocab_is_gamma():
    rng = np.random.default_rng(1)
    prev = rng.integers(0, 50000, 2000)
    tok = rng.integers(0, 50000, 2000)
    for gamma in (0.25, 0.5):
        frac = W.is_green(prev, tok, gamma).mean()
        assert abs(frac - gamma) < 4 * math.sqrt(gamma * (1 - gamma) / 2000), frac


def test_device_green_mask_equals_host():
    V = 1000
    prev = np.array([0, 7, 49151, 123456], np.int32)
    thr = np.full(4, W.Watermark(gamma=0.5).threshold, np.uint32)
    dev = np.asarray(jax.jit(W.green_mask, static_argnums=1)(prev, V, thr))
    host = np.stack([W.is_green(np.full(V, p), np.arange(V), 0.5) for p in prev])
    assert (dev == host).all()


def test_sampler_adds_delta_on_green_list_only():
    V = 64
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    prev = [11, 11, 40, 3]
    ps = [SP(temperature=0, watermark={"delta": 50.0}), SP(temperature=0),
          SP(temperature=0, watermark={"delta": 50.0, "gamma": 0.6}), SP(temperature=0, logprobs=2)]
    t = S.sampling_tensors_from_params(ps, [0] * 4, [0] * 4, 4, prev_tokens=prev)
    out = jax.jit(S.sample, static_argnames="num_logprobs")(logits, t, num_logprobs=2)
    tok = np.asarray(out.token_ids)
    # a huge delta: the greedy token is the best green one; unwatermarked rows are untouched
    for i, gamma in ((0, W.DEFAULT_GAMMA), (2, 0.6)):
        green = W.is_green(np.full(V, prev[i]), np.arange(V), gamma)
        assert tok[i] == np.flatnonzero(green)[np.argmax(logits[i][green])]
    assert tok[1] == np.argmax(logits[1]) and tok[3] == np.argmax(logits[3])
    # logprobs stay raw (before the bias), as every other processor leaves them
    lse = np.log(np.exp(logits[3].astype(np.float64)).sum())
    assert float(out.logprobs[3]) == pytest.approx(logits[3, tok[3]] - lse, abs=1e-5)
    with pytest.raises(ValueError, match="prev_tokens"):
        S.sampling_tensors_from_params([ps[0]], [0], [0], 1)


def test_engine_watermarks_every_step_and_multi_step_runs(tmp_path):
    """Through the engine: with a delta no logit gap survives, every sampled token is on the
    green list of the token before it, in single steps and in multi-step decode runs (where
    the previous token is fed on the device); an unwatermarked neighbour is unchanged."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from test_hf_oracle import FAMILIES, build_family

    build_family(next(f for f in FAMILIES if f.name == "llama"), str(tmp_path))
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
              page_buckets=(8,), min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),))
    prompts = [[1, 5, 9, 33], [1, 70, 71]]
    wm = SP(max_tokens=20, seed=1, ignore_eos=True, watermark={"delta": 60.0})
    plain = SP(max_tokens=20, seed=2, ignore_eos=True)
    outs = {}
    for steps in (1, 4):
        eng = Engine(loaded=load_model(str(tmp_path), "float32"), progress=False, num_scheduler_steps=steps, **kw)
        runs, multi = [], eng.runner.dispatch_multi
        eng.runner.dispatch_multi = lambda *a: runs.append(a[-1]) or multi(*a)
        outs[steps] = eng.generate(prompts, [wm, plain])
        assert bool(runs) == (steps > 1)            # multi-step runs did happen
    for steps, (a, b) in outs.items():
        toks = [prompts[0][-1]] + a.outputs[0].token_ids
        assert W.is_green(toks[:-1], toks[1:]).all(), steps
    assert outs[1][0].outputs[0].token_ids == outs[4][0].outputs[0].token_ids
    assert outs[1][1].outputs[0].token_ids == outs[4][1].outputs[0].token_ids

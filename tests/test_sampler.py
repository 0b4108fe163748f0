"""On-device sampler: filters, penalties, greedy, seeds, logprobs, packing.

Distributions are checked empirically against a numpy reference of the filtered,
renormalized distribution; seeds are fixed, so every test is deterministic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling_params import SamplingParams as SP
from jaxinfer.engine import sampler as S

_sample = jax.jit(S.sample, static_argnames=("num_logprobs", "topk_cap", "num_proposals", "row_block"))

# Few distinct shapes and static settings, so the suite compiles the sampler only a few times:
# every vocabulary is padded with -inf to V_PAD (padding tokens have probability 0).
V_PAD = 64
SMALL_B, SMALL_K = 8, 4
EMP_N = 4096
TIGHT = {"topk_cap": 4, "num_proposals": 1}   # large-top-k bisection; nucleus fallback on most rows


def pad_vocab(logits):
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    return np.pad(logits, ((0, 0), (0, V_PAD - logits.shape[1])), constant_values=-np.inf)


def run(logits, params, seeds=None, steps=None, prompt=None, counts=None, batch_size=SMALL_B, **kw):
    """Rows of ``logits`` (vocab <= V_PAD) in a batch of ``batch_size`` (rest is padding)."""
    args, kwargs = batch(logits, params, seeds, steps, prompt, counts, batch_size)
    out = _sample(*args, num_logprobs=SMALL_K, **kwargs, **kw)
    return S.SampleOutput(*(np.asarray(a)[:len(params)] for a in out))


def batch(logits, params, seeds=None, steps=None, prompt=None, counts=None, batch_size=SMALL_B):
    n = len(params)
    x = pad_vocab(logits)
    x = np.concatenate([x, np.zeros((batch_size - len(x), V_PAD), np.float32)])
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    t = S.sampling_tensors_from_params(params, seeds, steps, batch_size)
    # penalty state as a runner keeps it: more rows than the batch, indexed by penalty_rows
    rows = np.arange(batch_size, dtype=np.int32)[::-1] + 3
    pm = np.zeros((batch_size + 3, V_PAD), bool)
    oc = np.zeros((batch_size + 3, V_PAD), np.int32)
    oc[:3] = 7                                              # rows no one reads
    if prompt is not None:
        pm[rows[:n], :prompt.shape[1]], oc[rows[:n], :counts.shape[1]] = prompt, counts
    return (x, t), dict(prompt_mask=pm, output_counts=oc, penalty_rows=rows)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def reference(logits, p: SP):
    """The filtered, renormalized distribution, following the module's documented rules."""
    v = len(logits)
    s = np.asarray(logits, np.float64) / p.temperature
    probs = softmax(s)
    order = np.lexsort((np.arange(v), -s))                 # value desc, id asc
    k = v if p.top_k <= 0 or p.top_k >= v else p.top_k
    top = order[:k]
    pk = probs[top] / probs[top].sum()
    excl = np.concatenate([[0.0], np.cumsum(pk)[:-1]])
    kept = top[excl < p.top_p] if p.top_p < 1 else top
    kept = kept[probs[kept] >= p.min_p * probs.max()]
    q = np.zeros(v)
    q[kept] = probs[kept]
    return q / q.sum()


def empirical(logits, p: SP, n=EMP_N, seed0=0, **kw):
    """Token frequencies of n rows sampled from the same logits with seeds seed0, seed0+1, ..."""
    counts = np.zeros(len(logits))
    x = np.broadcast_to(pad_vocab(logits), (EMP_N, V_PAD))
    for start in range(seed0, seed0 + n, EMP_N):
        t = S.sampling_tensors_from_params([p] * EMP_N, list(range(start, start + EMP_N)), [0] * EMP_N, EMP_N)
        toks = np.asarray(_sample(x, t, row_block=64, **kw).token_ids)
        assert toks.max() < len(logits)
        counts += np.bincount(toks, minlength=len(logits))
    return counts / counts.sum()


def assert_matches(freq, q, n=EMP_N):
    """Support equal; a chi-square bound whose false-alarm rate is negligible (fixed seeds anyway)."""
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(q)), (freq, q)
    big = q > 0
    assert set(np.flatnonzero(q > 20 / n)) <= set(np.flatnonzero(freq)), (freq, q)
    chi2 = n * np.sum((freq[big] - q[big]) ** 2 / q[big])
    df = max(int(big.sum()) - 1, 1)
    assert chi2 < df + 7 * np.sqrt(2 * df) + 10, (chi2, df, freq, q)


# --------------------------------------------------------------------------- greedy

def test_greedy_is_argmax_first_index_on_ties():
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    out = run(logits, [SP(temperature=0)] * 3)
    np.testing.assert_array_equal(out.token_ids, [1, 0, 0])
    wide = np.full((2, 49152 + 5), -1.0, np.float32)             # vocab not a multiple of the chunk
    wide[0, [49155, 70000 % 49157]] = 2.0
    wide[1, [130, 300]] = 2.0
    idx = np.asarray(jax.jit(S._first_max_index)(wide))
    np.testing.assert_array_equal(idx, np.argmax(wide, axis=1))


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(SMALL_B, V_PAD)), 1)     # rounding makes ties likely
    g = run(logits, [SP(temperature=0)] * SMALL_B).token_ids
    k1 = run(logits, [SP(temperature=1.3, top_k=1)] * SMALL_B).token_ids
    np.testing.assert_array_equal(g, np.argmax(logits, axis=1))
    np.testing.assert_array_equal(k1, g)


# --------------------------------------------------------------------------- filters

def test_top_k_keeps_exactly_the_k_largest_with_id_tie_break():
    # ids 1, 4, 6 tie for second place; top_k=3 must keep 0 (best), 1 and 4.
    logits = np.array([2.0, 1.0, 0.0, -1.0, 1.0, 0.5, 1.0, -3.0])
    for kw in ({}, TIGHT):                 # candidate path (k <= cap) and bisection path (k > cap)
        for p in (SP(top_k=3), SP(top_k=3, temperature=3.0)):
            freq = empirical(logits, p, **kw)
            assert set(np.flatnonzero(freq)) == {0, 1, 4}
            assert_matches(freq, reference(logits, p))


def test_top_p_minimal_nucleus_hand_example():
    # ranking 1 (.5), 2 (.25), 3 (.125), 0 (.1), 4 (.025); exclusive sums 0 .5 .75 .875 .975
    logits = np.log(np.array([0.1, 0.5, 0.25, 0.125, 0.025]))
    cases = {0.49: {1}, 0.51: {1, 2}, 0.74: {1, 2}, 0.76: {1, 2, 3}, 0.95: {0, 1, 2, 3},
             0.98: {0, 1, 2, 3, 4}, 1.0: {0, 1, 2, 3, 4}}
    for top_p, want in cases.items():
        # rejection, rejection + fallback, candidates, bisection top-k (all 5 tokens) + fallback
        for extra, kw in (({}, {}), ({}, TIGHT), ({"top_k": 5}, {}), ({"top_k": 5}, TIGHT)):
            p = SP(top_p=top_p, **extra)
            freq = empirical(logits, p, **kw)
            assert set(np.flatnonzero(freq)) == want, (top_p, extra, kw, freq)
            assert_matches(freq, reference(logits, p))
    # top-p acts on the top-k-renormalized distribution: top-4 mass .975, so .51 keeps one token
    freq = empirical(logits, SP(top_p=0.51, top_k=4))
    assert set(np.flatnonzero(freq)) == {1}


def test_top_p_ties_at_the_boundary_break_by_id():
    # 0.4 at id 2; three 0.2's at ids 3, 0, 4. Ranking: 2, 0, 3, 4 (ties by id).
    logits = np.log(np.array([0.2, 1e-9, 0.4, 0.2, 0.2]))
    for top_p, want in ((0.5, {2, 0}), (0.7, {2, 0, 3}), (0.35, {2})):
        for extra, kw in (({}, {}), ({}, TIGHT), ({"top_k": 4}, {}), ({"top_k": 5}, TIGHT)):
            freq = empirical(logits, SP(top_p=top_p, **extra), **kw)
            assert set(np.flatnonzero(freq)) == want, (top_p, extra, kw, freq)


def test_min_p():
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.15]))
    for min_p, want in ((0.35, {1, 2}), (0.25, {1, 2, 3}), (0.0, {0, 1, 2, 3}), (1.0, {1})):
        for extra in ({}, {"top_k": 4}, {"top_p": 0.99}):
            p = SP(min_p=min_p, **extra)
            freq = empirical(logits, p)
            assert set(np.flatnonzero(freq)) == want, (min_p, extra, freq)
            assert_matches(freq, reference(logits, p))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_scales_frequencies(temperature):
    logits = np.array([1.0, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5, 0.2])
    n = 4 * EMP_N
    freq = empirical(logits, SP(temperature=temperature), n=n)
    q = softmax(logits / temperature)
    assert_matches(freq, q, n=n)
    assert np.all(np.abs(freq - q) <= 4 * np.sqrt(q * (1 - q) / n) + 1e-3), (freq, q)


@pytest.mark.parametrize("params,kw", [
    (SP(top_k=6, temperature=0.8), {}),
    (SP(top_k=6, top_p=0.8, temperature=1.2), {}),
    (SP(top_k=6, top_p=0.8, min_p=0.1), {}),
    (SP(top_k=12, top_p=0.9), TIGHT),                 # bisection top-k, nucleus by rejection/fallback
    (SP(top_k=20), TIGHT),
    (SP(top_p=0.6, temperature=1.5), {}),
    (SP(top_p=0.3, temperature=3.0), TIGHT),          # most rows reach the fallback
    (SP(top_p=0.3, top_k=25, min_p=0.05, temperature=3.0), TIGHT),
])
def test_filtered_distribution_matches_reference(params, kw):
    rng = np.random.default_rng(7)
    logits = rng.normal(size=40) * 1.5
    logits[[3, 17, 30]] = logits[5]                   # a few exact ties
    n = 2 * EMP_N
    freq = empirical(logits, params, n=n, **kw)
    assert_matches(freq, reference(logits, params), n=n)


def test_bisect_boundary_matches_sorted_reference():
    rng = np.random.default_rng(3)
    b, v = 6, 300
    s = rng.integers(-20, 20, size=(b, v)).astype(np.float32) / 4        # many ties
    s[0, :] = 0.0
    s[1, ::2] = -0.0                                                     # -0 and +0 are one value
    w = np.exp(s - s.max(axis=1, keepdims=True)).astype(np.float32)
    eligible = rng.random((b, v)) < 0.8
    eligible[:, 0] = True
    ks = [1, 7, 50, 150, 299, 3]
    # one executable: rows 0-5 weighted (three thresholds), rows 6-11 counting (top-k)
    f = jax.jit(lambda s, w, thr, el: S._bisect_boundary(S._ordered_key(s), jnp.where(el, w, 0), thr, el))
    wel = np.where(eligible, w, 0)
    for thr_frac in (0.05, 0.3, 0.77):
        thr = (thr_frac * wel.sum(axis=1)).astype(np.float32)
        mask = np.asarray(f(np.concatenate([s, s]), np.concatenate([w, np.ones_like(w)]),
                            np.concatenate([thr, np.float32(ks)]),
                            np.concatenate([eligible, np.ones_like(eligible)])))
        for r in range(b):
            order = [i for i in np.lexsort((np.arange(v), -s[r].astype(np.float64))) if eligible[r, i]]
            acc, keep = 0.0, set()
            for i in order:                    # keep while the weight ranked before is < thr
                if acc < thr[r]:
                    keep.add(i)
                acc += float(wel[r, i])
            assert set(np.flatnonzero(mask[r])) == keep, (r, thr_frac)
        for r, k in enumerate(ks):
            order = np.lexsort((np.arange(v), -s[r].astype(np.float64)))
            assert set(np.flatnonzero(mask[b + r])) == set(order[:k])


def test_search_lands_on_positive_weight():
    w = np.zeros((3, 300), np.float32)
    w[0, [5, 200]] = 1.0
    w[1, 299] = 3.0
    w[2, :] = 1.0
    u = np.array([[0.0, 0.49, 0.5, 0.9999999]] * 3, np.float32)
    idx = np.asarray(jax.jit(S._search)(w, u))
    np.testing.assert_array_equal(idx[0], [5, 5, 200, 200])
    np.testing.assert_array_equal(idx[1], [299] * 4)
    np.testing.assert_array_equal(idx[2], [0, 147, 150, 299])


# --------------------------------------------------------------------------- penalties

def test_penalties_equal_hand_computation():
    logits = np.array([[2.0, -1.0, 0.0, 0.5, -0.5, 3.0], [1.0, 1.0, 1.0, -1.0, -2.0, 0.0]], np.float32)
    prompt = np.array([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    counts = np.array([[0, 0, 2, 1, 0, 0], [3, 0, 0, 1, 0, 0]], np.int32)
    ps = [SP(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
          SP(repetition_penalty=0.5, frequency_penalty=-1.0)]
    t = S.sampling_tensors_from_params(ps, [0, 0], [0, 0], 2)
    got = np.asarray(jax.jit(S.apply_penalties)(logits, prompt, counts, t))
    want = logits.astype(np.float64).copy()
    for r, p in enumerate(ps):
        for i in range(6):
            if prompt[r, i] or counts[r, i] > 0:
                rep = p.repetition_penalty
                want[r, i] = want[r, i] / rep if want[r, i] > 0 else want[r, i] * rep
            want[r, i] -= p.frequency_penalty * counts[r, i] + p.presence_penalty * (counts[r, i] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # inside sample: greedy follows the penalized logits, logprobs stay raw
    greedy = [p.replace(temperature=0, logprobs=2) for p in ps] + [SP(temperature=0, logprobs=2)]
    out = run(np.concatenate([logits, logits[:1]]), greedy, prompt=np.concatenate([prompt, prompt[:1]]),
              counts=np.concatenate([counts, counts[:1]]))
    np.testing.assert_array_equal(out.token_ids, list(np.argmax(want, axis=1)) + [5])
    raw_lp = np.asarray(jax.nn.log_softmax(logits[[0, 1, 0]]))
    np.testing.assert_allclose(out.logprobs, raw_lp[np.arange(3), out.token_ids], rtol=1e-6)


# --------------------------------------------------------------------------- seeds

def test_seeded_rows_are_independent_of_batch():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(SMALL_B, V_PAD)).astype(np.float32) * 1.5
    ps = [SP(), SP(top_k=10), SP(top_p=0.9), SP(temperature=0), SP(min_p=0.05, temperature=0.7),
          SP(top_k=40, top_p=0.95), SP(top_p=0.5, temperature=2.0), SP(top_k=3, top_p=0.5)]
    seeds = [11, 22, 33, 44, 55, 2**40 + 66, 77, 88]
    steps = [0, 3, 5, 1, 9, 2, 4, 0]
    full = run(logits, ps, seeds, steps).token_ids
    np.testing.assert_array_equal(full, run(logits, ps, seeds, steps).token_ids)
    for i in range(SMALL_B):
        alone = run(logits[i:i + 1], [ps[i]], [seeds[i]], [steps[i]], batch_size=1)
        assert alone.token_ids[0] == full[i], i
    perm = [7, 2, 5, 0, 1, 6, 3, 4]
    shuffled = run(logits[perm], [ps[i] for i in perm], [seeds[i] for i in perm], [steps[i] for i in perm])
    np.testing.assert_array_equal(shuffled.token_ids, full[perm])
    # fewer rows, greedy neighbours: the sampled rows must not notice
    mixed = run(logits[:3], [SP(temperature=0), ps[1], ps[2]], [0, seeds[1], seeds[2]],
                [0, steps[1], steps[2]])
    np.testing.assert_array_equal(mixed.token_ids[1:3], full[1:3])


def test_seeded_rows_are_independent_of_batch_on_every_path():
    # bisection top-k and the nucleus fallback too (TIGHT), with blocks of 64 mixed rows
    rng = np.random.default_rng(8)
    x = np.repeat(rng.normal(size=(EMP_N // 8, V_PAD)).astype(np.float32) * 2, 8, axis=0)
    kinds = [SP(), SP(top_k=3), SP(top_k=30, top_p=0.8), SP(top_p=0.3, temperature=2.0),
             SP(temperature=0), SP(min_p=0.2), SP(top_k=9, min_p=0.1, temperature=3.0), SP(top_p=0.95)]
    ps = [kinds[i % 8] for i in range(EMP_N)]
    seeds, steps = list(range(EMP_N)), [i % 5 for i in range(EMP_N)]
    def draw(idx):
        t = S.sampling_tensors_from_params([ps[i] for i in idx], [seeds[i] for i in idx],
                                           [steps[i] for i in idx], EMP_N)
        return np.asarray(_sample(x[idx], t, row_block=64, **TIGHT).token_ids)

    base = draw(np.arange(EMP_N))
    perm = rng.permutation(EMP_N)
    np.testing.assert_array_equal(draw(perm), base[perm])


def test_different_seeds_and_steps_differ():
    logits = np.zeros(V_PAD)                                 # uniform: collisions ~ 1/64
    t = S.sampling_tensors_from_params([SP()] * EMP_N, list(range(EMP_N)), [0] * EMP_N, EMP_N)
    x = np.zeros((EMP_N, V_PAD), np.float32)
    draw = lambda t: np.asarray(_sample(x, t, row_block=64).token_ids)  # noqa: E731
    a = draw(t)
    b = draw(dataclasses.replace(t, step=np.ones(EMP_N, np.int32)))
    c = draw(dataclasses.replace(t, seed=t.seed + np.array([1, 0], np.uint32)))   # seed + 2**32
    assert np.all(np.bincount(a, minlength=V_PAD) > 0) and len(logits) == V_PAD
    assert np.mean(a == b) < 0.03 and np.mean(a == c) < 0.03 and np.mean(b == c) < 0.03


def test_seed_is_64_bit():
    t = S.sampling_tensors_from_params([SP(), SP(), SP()], [5, 2**32 + 5, -1], [0, 0, 0], 3)
    np.testing.assert_array_equal(t.seed, [[0, 5], [1, 5], [0xFFFFFFFF, 0xFFFFFFFF]])
    key = jax.random.key_data(jax.random.PRNGKey(5))
    np.testing.assert_array_equal(t.seed[0], np.asarray(key))   # = jax's own seeding below 2**32


# --------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax_and_sorted():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, V_PAD)).astype(np.float32) * 3
    ps = [SP(logprobs=5, temperature=0.3, top_k=4), SP(logprobs=0, repetition_penalty=1.5),
          SP(temperature=0, logprobs=20), SP()]
    out = run(logits, ps, prompt=np.ones((4, V_PAD), bool), counts=np.zeros((4, V_PAD), np.int32))
    lsm = np.asarray(jax.nn.log_softmax(logits))
    for r in range(3):
        assert out.logprobs[r] == pytest.approx(lsm[r, out.token_ids[r]], abs=1e-5)
        if ps[r].logprobs == 0:       # the chosen token's only (its alternatives: zeros, or
            continue                  # a block-mate's by-product; nobody reads them)
        np.testing.assert_array_equal(out.top_ids[r], np.argsort(-lsm[r], kind="stable")[:SMALL_K])
        np.testing.assert_allclose(out.top_logprobs[r], np.sort(lsm[r])[::-1][:SMALL_K], atol=1e-5)
        assert np.all(np.diff(out.top_logprobs[r]) <= 0)
    assert out.logprobs[3] == 0.0                                  # not requested
    # num_logprobs=0 (the empirical harness's executable): chosen logprob only, empty tops
    t = S.sampling_tensors_from_params([ps[0]] * EMP_N, list(range(EMP_N)), [0] * EMP_N, EMP_N)
    empty = _sample(np.broadcast_to(logits[0], (EMP_N, V_PAD)), t, row_block=64)
    assert empty.top_ids.shape == (EMP_N, 0) and empty.top_logprobs.shape == (EMP_N, 0)
    np.testing.assert_allclose(empty.logprobs, lsm[0, np.asarray(empty.token_ids)], atol=1e-5)


def test_pack_unpack_round_trip():
    logits = np.random.default_rng(4).normal(size=(3, 50)).astype(np.float32)
    out = run(logits, [SP(logprobs=3), SP(temperature=0, logprobs=3), SP()])
    packed = S.pack(S.SampleOutput(*map(jnp.asarray, out)))
    assert packed.dtype == jnp.int32 and packed.shape == (3, 2 + 2 * SMALL_K)
    for a, b in zip(S.unpack(np.asarray(packed)), out):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- batch plumbing

def test_padded_rows_are_greedy_and_harmless():
    """Padding rows (missing / None) are greedy, marked by PAD_TEMPERATURE; one beside a
    real row in a block gets the argmax, blocks of padding only are skipped; the real
    rows' bits do not depend on how many padding rows surround them."""
    t = S.sampling_tensors_from_params([SP(top_p=0.9), None], [1, 2], [0, 0], 4)
    assert list(t.temperature) == [1.0] + [S.PAD_TEMPERATURE] * 3 and S.PAD_TEMPERATURE < 0
    assert list(t.num_logprobs) == [-1, -1, -1, -1]
    logits = np.random.default_rng(5).normal(size=(2, V_PAD)).astype(np.float32)
    # in blocks of 4 rows (the default block is 1 row: a padding row then has no block)
    out = run(logits, [SP(top_p=0.9), None], [1, 2], row_block=4)
    alone = run(logits[:1], [SP(top_p=0.9, logprobs=2)], [1], batch_size=1)
    assert out.token_ids[0] == alone.token_ids[0]
    assert out.token_ids[1] == np.argmax(logits[1])
    assert run(logits, [SP(top_p=0.9), None], [1, 2]).token_ids[0] == alone.token_ids[0]
    for width in (16, 18):                # wider than a block of 4 and than 4 blocks of 4
        wide = run(logits[:1], [SP(top_p=0.9, logprobs=2)], [1], batch_size=width)
        assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(wide, alone))


def test_one_executable_serves_any_mix():
    logits = np.random.default_rng(6).normal(size=(SMALL_B, V_PAD)).astype(np.float32)
    pm, oc = np.zeros((SMALL_B, V_PAD), bool), np.zeros((SMALL_B, V_PAD), np.int32)
    oc[:, :3] = 1
    (x, t0), kw = batch(logits, [])                                   # all padding
    compiled = _sample.lower(x, t0, num_logprobs=SMALL_K, **kw).compile()
    mixes = [[SP(temperature=0)] * 4, [SP(top_k=5), SP(top_p=0.5), SP(min_p=0.2), SP(top_k=100, top_p=0.9)],
             [SP(repetition_penalty=1.3, logprobs=2), SP(), SP(temperature=0), SP(top_k=1)]]
    for ps in mixes:
        args, kw = batch(logits, ps * 2, list(range(8)), list(range(8)), prompt=pm, counts=oc)
        got = compiled(*args, **kw)
        want = run(logits, ps * 2, list(range(8)), list(range(8)), prompt=pm, counts=oc)
        np.testing.assert_array_equal(np.asarray(got.token_ids), want.token_ids)


def test_shape_errors_name_the_field():
    t = S.sampling_tensors_from_params([SP()], [0], [0], 2)
    with pytest.raises(ValueError, match="logits"):
        S.sample(np.zeros((2, 3, 4), np.float32), t)
    with pytest.raises(ValueError, match="temperature"):
        S.sample(np.zeros((3, 8), np.float32), t)
    with pytest.raises(ValueError, match="num_logprobs"):
        S.sample(np.zeros((2, 8), np.float32), t, 9)
    with pytest.raises(ValueError, match="batch_size"):
        S.sampling_tensors_from_params([SP()] * 3, [0] * 3, [0] * 3, 2)
    with pytest.raises(ValueError, match="prompt_mask"):
        S.sample(np.zeros((2, 8), np.float32), t, prompt_mask=np.zeros((2, 8), bool))
    with pytest.raises(ValueError, match="penalty_rows"):
        S.sample(np.zeros((2, 8), np.float32), t, prompt_mask=np.zeros((5, 8), bool),
                 output_counts=np.zeros((5, 8), np.int32), penalty_rows=np.zeros(3, np.int32))

"""Multi-step decode (``EngineConfig.num_scheduler_steps``): several decode steps in one
device call, sampled tokens fed back on the device. It must give exactly the tokens of
single steps (greedy, seeded sampling, penalties, logprobs), stop a sequence where a single
step would (EOS, stop strings, max_tokens, max_model_len) without a token more, leak no
page, compile nothing after warm-up, and step aside whenever a prefill is waiting.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine_config import EngineConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.engine import Engine

from test_engine import run_with_arrivals, stream_through_async_engine, tiny_loaded

STEPS = 4
# Small ladders: few executables to compile (a multi-step one per decode bucket).
KW = dict(progress=False, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=64,
          max_waiting=16, min_sampler_rows=16, decode_buckets=(2, 8), mixed_decode_buckets=(0, 8), prefill_buckets=((1, 64),))


@pytest.fixture(scope="module")
def tiny(default_loaded):
    return tiny_loaded(default_loaded.tokenizer)


@pytest.fixture(scope="module")
def default_loaded():
    from jaxinfer.loading import load_model

    return load_model(None, "float32")


@pytest.fixture(scope="module")
def multi(tiny):
    return Engine(loaded=tiny, num_scheduler_steps=STEPS, **KW)


@pytest.fixture(scope="module")
def single(tiny):
    return Engine(loaded=tiny, **KW)


def _params():
    # max_tokens that are not multiples of STEPS, every sampling feature
    return [
        SamplingParams(temperature=0, max_tokens=21, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.7),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=18, seed=123, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=5),
    ]


def test_multi_step_matches_single_steps_token_for_token(multi, single):
    """Against the single-step engine (itself token-exact against the reference generator,
    tests/test_engine.py), with every sampling feature and uneven max_tokens."""
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 49152, size=n).tolist() for n in (1, 7, 40, 100, 130)]
    params = _params()
    want = single.generate(prompts, params)
    steps0 = multi.num_steps
    calls = 0
    ids = [multi.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {}
    while multi.has_unfinished():
        calls += 1
        for o in multi.step():
            if o.finished:
                outs[o.request_id] = o
    # Fewer step() calls than decode steps: the runs really were multi-step.
    assert calls < (multi.num_steps - steps0) * 0.6
    for rid, p, w in zip(ids, params, want):
        got, w = outs[rid].outputs[0], w.outputs[0]
        assert got.token_ids == w.token_ids, f"{p}"
        assert len(got.token_ids) == p.max_tokens and got.finish_reason == "length"
        if p.logprobs is not None:
            assert [(x.token_id, [i for i, _ in x.top]) for x in got.logprobs] == \
                   [(x.token_id, [i for i, _ in x.top]) for x in w.logprobs]
            np.testing.assert_allclose([x.logprob for x in got.logprobs], [x.logprob for x in w.logprobs],
                                       rtol=1e-6, atol=1e-6)
    s = multi.stats()
    assert s["num_free_pages"] == s["num_total_pages"], "leaked KV pages"


def test_multi_step_stops_exactly_like_single_steps(multi, single):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = single.generate("Once upon a time", base)[0].outputs[0]
    assert len(full.text) > 8
    stop = full.text[5:8]
    eos = full.token_ids[6]                                 # an "EOS" that lands mid-run
    cases = [base, base.replace(stop=(stop,)), base.replace(stop=(stop,), include_stop_str_in_output=True),
             base.replace(stop_token_ids=(eos,)), base.replace(max_tokens=6),
             SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)]   # max_model_len ends it
    for p in cases:
        a = single.generate("Once upon a time", p)[0].outputs[0]
        b = multi.generate("Once upon a time", p)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
               (a.token_ids, a.text, a.finish_reason, a.stop_reason), f"{p}"
    s = multi.stats()
    assert s["num_free_pages"] == s["num_total_pages"], "leaked KV pages"


def test_multi_step_under_arrivals_no_compile_no_leak(multi, single):
    """Requests arriving while others decode: multi-step runs only when nobody waits, and
    every request still gets the single-step engine's tokens; nothing compiles."""
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 49152, size=int(n)).tolist() for n in rng.randint(1, 90, size=12)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True, n=1 + (i % 5 == 0))
              for i, m in enumerate(rng.randint(1, 30, size=12))]
    want = [o.outputs for o in single.generate(prompts, params)]
    outs, compiles = run_with_arrivals(multi, prompts, params, rng, "a", max_per_step=2)
    assert compiles == 0, f"{compiles} compiles after warm-up"
    for k in range(len(prompts)):
        assert [c.token_ids for c in outs[f"a{k}"].outputs] == [c.token_ids for c in want[k]], k
    s = multi.stats()
    assert s["num_free_pages"] == s["num_total_pages"], "leaked KV pages"


def test_multi_step_waits_for_prefills_and_streams_runs(multi):
    """A waiting prompt is never delayed by a multi-step run; outputs of a run arrive as
    one cumulative snapshot per request."""
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = multi.add_request([5, 6, 7], p)
    multi.step()                                            # prefill of a: its first token
    b = multi.add_request([8, 9, 10, 11], p)
    assert multi.scheduler.schedule_decode_run(STEPS) is None, "b waits: no multi-step run"
    outs = multi.step()                                     # a decodes, b prefills
    assert {o.request_id for o in outs} == {a, b}
    lens = {o.request_id: len(o.outputs[0].token_ids) for o in outs}
    assert lens == {a: 2, b: 1}
    outs = multi.step()                                     # both decode: one run of STEPS
    assert sorted(len(o.outputs[0].token_ids) for o in outs) == [1 + STEPS, 2 + STEPS]
    while multi.has_unfinished():
        multi.step()


def test_multi_step_int8_matches_single_step(tiny):
    p = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7], list(range(100, 160))]
    a = Engine(loaded=tiny, quantization="int8", **KW).generate(prompts, p)
    b = Engine(loaded=tiny, quantization="int8", num_scheduler_steps=3, **KW).generate(prompts, p)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_num_scheduler_steps_validated():
    for bad in (0, -1, 2.5, "4"):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineConfig(num_scheduler_steps=bad)


def test_async_engine_streams_multi_step_runs(multi, single):
    """The server's path: AsyncEngine over a multi-step engine streams cumulative outputs
    (several tokens per update) that end in the single-step engine's tokens."""
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["Hello there", "General Kenobi"]
    want = single.generate(prompts, p)
    for (final, seen), w in zip(stream_through_async_engine(multi, prompts, p), want):
        assert final.finished and final.outputs[0].token_ids == w.outputs[0].token_ids
        assert all(seen[i + 1][:len(seen[i])] == seen[i] for i in range(len(seen) - 1))
        assert len(seen) < 10, "multi-step runs deliver several tokens per update"


def test_constrained_requests_run_single_steps_beside_multi_step(multi, single):
    """A grammar needs the host between tokens: while one runs, the engine takes single
    steps, and its neighbours' tokens stay those of plain single steps."""
    import re

    plain = _params()[:2]
    want = [o.outputs[0].token_ids for o in single.generate(["a b c", "d e"], plain)]
    guided = SamplingParams(temperature=0, max_tokens=12, guided={"regex": "[0-9]{3}-[a-z]{2}"})
    outs = multi.generate(["a b c", "d e", "pick"], plain + [guided])
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[2].outputs[0].text)

"""The overlapped step loop (EngineConfig.async_scheduling, engine/engine.py) against the
synchronous one, on the same tiny model: every output bitwise the same (tokens, logprobs,
text, finish and stop reasons, token counts) across stops found a step late (EOS, stop
tokens, stop strings, max_tokens), preemption, prefix-cache hits, n > 1, seeded sampling,
penalties, guided decoding, watermarks and beam search mixed with plain requests, requests
arriving while steps are in flight and aborts mid-flight; no compile after warm-up, no
leaked pages, and proof that steps really were scheduled with tokens in flight.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine.engine import Engine
from jaxinfer.sampling_params import SamplingParams as SP
from test_engine import COMPILES, TINY_ENGINE_KW, tiny_loaded


@pytest.fixture(scope="module")
def loaded():
    from jaxinfer.loading import load_model

    return tiny_loaded(load_model(None, "float32").tokenizer)


def engines(loaded, **kw) -> dict[bool, Engine]:
    """The same engine twice: overlapped (True) and synchronous (False)."""
    cfg = dict(TINY_ENGINE_KW, **kw)
    return {a: Engine(loaded=loaded, progress=False, async_scheduling=a, **cfg) for a in (True, False)}


@pytest.fixture(scope="module")
def shared(loaded):
    """One pair for the tests of the default shape (engines cost ~20 s each to build)."""
    return engines(loaded)


@pytest.fixture
def pair(shared):
    yield shared
    for eng in shared.values():
        eng.fault_hook = None


class Overlaps:
    """Counts scheduled steps that held a sequence with a token still in flight (the
    engine's fault hook sees every step before its batch is built)."""

    def __init__(self, eng: Engine):
        self.steps = self.pending_rows = 0
        eng.fault_hook = self

    def __call__(self, sched) -> None:
        n = sum(e.seq.num_pending > 0 for e in sched.scheduled)
        self.steps += n > 0
        self.pending_rows += n


def drive(eng: Engine, prompts, params, arrivals=None, aborts=None):
    """Add request i before step ``arrivals[i]`` (default: all first), abort request ids at
    the steps ``aborts`` names, step until done -> ({id: final output}, compiles meanwhile)."""
    arrivals = arrivals or [0] * len(prompts)
    aborts = aborts or {}
    outs, step = {}, 0
    COMPILES.count, COMPILES.active = 0, True
    try:
        while step <= max(arrivals) or eng.has_unfinished():
            for i, (p, sp) in enumerate(zip(prompts, params)):
                if arrivals[i] == step:
                    eng.add_request(p, sp, request_id=f"r{i}")
            for rid in aborts.get(step, ()):
                eng.abort(rid)
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            step += 1
            assert step < 2000, "did not drain"
        return outs, COMPILES.count
    finally:
        COMPILES.active = False


def view(out) -> list:
    """Everything a caller sees of a finished request, logprobs as raw float bits."""
    def lps(c):
        return None if c.logprobs is None else [
            (lp.token_id, np.float32(lp.logprob).tobytes(), tuple((i, np.float32(x).tobytes()) for i, x in lp.top))
            for lp in c.logprobs]
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps(c)) for c in out.outputs]


def compare(pair: dict[bool, Engine], prompts, params, **drive_kw) -> dict:
    """Run both engines; assert bitwise equal outputs and usage, no compiles, no leaked
    pages; returns the overlapped engine's outputs."""
    res = {}
    for a, eng in pair.items():
        gen0 = eng.stats()["generation_tokens_total"]
        outs, compiles = drive(eng, prompts, params, **drive_kw)
        assert compiles == 0, f"async_scheduling={a}: {compiles} compiles after warm-up"
        st = eng.stats()
        assert st["num_free_pages"] == st["num_total_pages"], f"async_scheduling={a}: pages leaked"
        res[a] = ({k: view(o) for k, o in outs.items()}, st["generation_tokens_total"] - gen0)
    assert res[True][0].keys() == res[False][0].keys()
    for k in res[False][0]:
        assert res[True][0][k] == res[False][0][k], f"request {k} differs"
    assert res[True][1] == res[False][1], "generation token counts differ"
    return res[True][0]


def test_the_engine_overlaps_by_default(pair):
    assert pair[True].stats()["async_scheduling"] and pair[True].overlap_blocker is None
    assert not pair[False].stats()["async_scheduling"]
    assert "async_scheduling" in pair[False].stats()["async_scheduling_off_because"]
    seen = Overlaps(pair[True])
    compare(pair, [[5, 6, 7, 8] * 4] * 3, [SP(max_tokens=16, ignore_eos=True)] * 3)
    # the rows' tokens went from one step to the next on the device
    assert seen.steps >= 12 and seen.pending_rows >= 36
    st = pair[True].stats()
    assert 0.0 <= st["overlapped_fraction"] <= 1.0 and st["host_ms_per_step"] > 0


def test_stops_found_a_step_late_match(pair):
    """EOS, a stop token, stop strings (cut inside the text, kept or not), max_tokens of 1,
    2 and more: the look-ahead token each sampled after its stop is dropped."""
    base = SP(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "Once upon a time"
    full = pair[False].generate(prompt, base)[0].outputs[0]
    assert len(full.text) > 8 and len(full.token_ids) == 24
    stop_tok = full.token_ids[6]
    params = [base, base.replace(stop=(full.text[5:8],)),
              base.replace(stop=(full.text[5:8],), include_stop_str_in_output=True),
              base.replace(stop_token_ids=(stop_tok,)),
              base.replace(ignore_eos=False),             # the tiny model's EOS (2) where it samples it
              base.replace(max_tokens=1), base.replace(max_tokens=2), base.replace(max_tokens=5),
              SP(temperature=0.9, seed=11, max_tokens=9, logprobs=3, stop_token_ids=(stop_tok,)),
              # samples of one request stopping at different steps: the request goes on
              # while a finished sample's look-ahead token resolves
              SP(temperature=4.0, seed=22, n=3, max_tokens=20, stop=("e",), ignore_eos=True)]
    outs = compare(pair, [prompt] * len(params), params)
    assert outs["r1"][0][3] == "stop" and outs["r3"][0][4] == stop_tok
    assert [len(outs[f"r{i}"][0][1]) for i in (5, 6, 7)] == [1, 2, 5]
    assert len({len(c[1]) for c in outs["r9"]}) > 1, "the samples should stop at different lengths"


def test_sampling_features_and_arrivals_match(pair):
    """Seeded sampling with logprobs, n > 1 and best_of, penalties, top-k / top-p / min-p,
    requests arriving while a step is in flight."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 4000, int(rng.integers(4, 50)))] for _ in range(10)]
    params = [SP(temperature=0, max_tokens=12, logprobs=2),
              SP(temperature=0.8, seed=3, max_tokens=9, logprobs=2, top_k=40),
              SP(temperature=0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
              SP(temperature=1.0, top_p=0.9, seed=7, n=3, max_tokens=7),
              SP(temperature=1.0, min_p=0.1, seed=8, best_of=3, max_tokens=6),
              SP(temperature=0.7, seed=9, max_tokens=15, ignore_eos=True, logprobs=5),
              SP(temperature=0, max_tokens=3), SP(temperature=2.0, seed=1, max_tokens=11, ignore_eos=True),
              SP(temperature=0, max_tokens=30, ignore_eos=True), SP(temperature=0.5, seed=4, n=2, max_tokens=8)]
    compare(pair, prompts, params, arrivals=[0, 0, 1, 2, 2, 3, 5, 6, 9, 13])


def test_preemption_and_prefix_cache_hits_match(loaded):
    """Few pages (sequences preempted with a token in flight recompute once it is here) and
    prefix caching (shared prefixes, repeated prompts: hits)."""
    pair = engines(loaded, num_pages=14, enable_prefix_caching=True)
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, 4000, 40)]
    prompts = [shared + [int(t) for t in rng.integers(3, 4000, int(rng.integers(1, 20)))] for _ in range(8)]
    prompts += prompts[:3]
    params = [SP(temperature=0.6, seed=i, max_tokens=int(rng.integers(20, 60)), ignore_eos=True)
              for i in range(len(prompts))]
    compare(pair, prompts, params, arrivals=[0, 0, 0, 1, 1, 2, 4, 4, 30, 31, 32])
    for eng in pair.values():
        st = eng.stats()
        assert st["num_preemptions_total"] > 0 and st["prefix_cache_hits_total"] > 0, st


def test_host_bound_requests_beside_plain_ones(pair):
    """Guided decoding, min_tokens, logit_bias, a watermark and beam search need the host
    between their steps: they wait for their token while the plain rows keep overlapping
    (never the whole batch synchronous); all outputs the same."""
    seen = Overlaps(pair[True])
    prompts = ["Hello there", "Give me a number", "Once upon", "The end", "A B C", "Tell me"]
    params = [SP(temperature=0, max_tokens=40, ignore_eos=True),
              SP(temperature=0, max_tokens=12, guided={"regex": r"[0-9]{3,8}"}),
              SP(temperature=0.8, seed=5, max_tokens=10, min_tokens=6, logit_bias={11: 3.0}),
              SP(temperature=0.9, seed=6, max_tokens=10, watermark=True),
              SP(temperature=0, max_tokens=6, beam_width=2),
              SP(temperature=0.7, seed=2, max_tokens=40, ignore_eos=True)]
    outs = compare(pair, prompts, params)
    assert outs["r1"][0][1] and outs["r1"][0][2].isdigit()
    assert seen.pending_rows > 0
    # no host-bound sequence was ever scheduled with its token in flight
    host_bound = {f"r{i}" for i in (1, 2, 3, 4)}

    def check(sched):
        for e in sched.scheduled:
            assert not (e.seq.num_pending and e.seq.request_id in host_bound), e.seq
        seen(sched)
    pair[True].fault_hook = check
    compare(pair, prompts, params)


def test_abort_mid_flight(pair):
    """An abort while the request's step is in flight: its pages come back at once, the
    others' outputs are untouched, what it had is a prefix of its whole run, and no token
    of a step in flight lands in it afterwards."""
    prompts = [[9, 10, 11] * 5, [21, 22, 23] * 4, [31, 32] * 6]
    params = [SP(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    whole, _ = drive(pair[True], prompts, params)
    eng = pair[True]
    ids = [eng.add_request(p, sp, request_id=f"a{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    got = {}
    for _ in range(6):
        for o in eng.step(deltas=False):
            got[o.request_id] = o
    assert eng._in_flight, "a step should be in flight"
    assert eng.abort(ids[1])
    st = eng.stats()
    seqs_left = sum(len(eng.output.requests[r].seqs) for r in eng.output.requests)
    assert seqs_left == 2
    before = list(got[ids[1]].outputs[0].token_ids)
    rest = eng.run_until_done([ids[0], ids[2]])
    assert [o.outputs[0].token_ids for o in rest] == [whole["r0"].outputs[0].token_ids,
                                                      whole["r2"].outputs[0].token_ids]
    assert before == whole["r1"].outputs[0].token_ids[:len(before)]
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"] and st["num_running"] == 0


def test_step_clock_counts_only_host_work_the_device_waited_for():
    """The clock's critical path: all of a synchronous call's host work; none of an
    overlapped call's while the step in flight is still running; nothing between calls."""
    import time

    from jaxinfer.engine.step_clock import Launched, StepClock

    class Handle:
        def __init__(self, ready):
            self.ready = ready

        def is_ready(self):
            return self.ready

    clock, in_flight = StepClock(), []
    with clock.call(in_flight) as t:            # synchronous: nothing in flight
        time.sleep(0.02)
        clock.before_dispatch(in_flight)
        with clock.waiting(t):
            time.sleep(0.01)
        time.sleep(0.02)
        t.steps = 1
    # (bounds from the sleeps alone: no wall-clock window)
    assert 0.04 <= clock.critical <= clock.host and clock.device >= 0.01
    time.sleep(0.05)                             # idle between calls: nobody's
    busy = [[Launched(None, None, None, Handle(False))]]
    before = clock.critical
    with clock.call(busy) as t:                 # overlapped: the step in flight still runs
        time.sleep(0.02)
        clock.before_dispatch(busy)
        time.sleep(0.02)
        t.steps = 1
    assert clock.critical == before
    busy[0][0].handle.ready = True               # the device outran the host: it counts
    with clock.call(busy) as t:
        time.sleep(0.02)
        clock.before_dispatch(busy)
        t.steps = 1
    assert clock.critical - before >= 0.02
    st = clock.stats()
    assert 0.0 < st["overlapped_fraction"] < 1.0 and st["critical_host_ms_per_step"] <= st["host_ms_per_step"]

"""The continuous-batching engine against the reference generator.

Token-exact under batching (requests arriving at different steps, chunked prefill and
preemption forced), zero compiles after warm-up, no leaked KV pages; plus the engine's
own features (n > 1, stop strings, penalties, logprobs, abort, limits) on a tiny model.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from jaxinfer.models.config import ModelConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.errors import QueueFullError
from jaxinfer.loading import LoadedModel, load_model
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.reference import ReferenceGenerator
from prompt_data import BUILTIN_QUESTIONS, mt_bench_turns, questions


class CompileCounter:
    """Counts XLA backend compiles (jax.monitoring events) while active."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, secs, **kw):
        if self.active and name == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


@pytest.fixture(scope="module")
def default_loaded():
    return load_model(None, "float32")


def tiny_loaded(tokenizer, **overrides) -> LoadedModel:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_ids=(2,), **overrides)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    # Spread the logits so greedy decoding is not a coin toss between near-ties.
    emb = model.embed[...]
    model.embed.set_value(emb * 40.0)
    model.lm_head.set_value(emb.T * 40.0)
    return LoadedModel(cfg, model, tokenizer, {}, "tiny-random-llama")


# Decode 1 / 8 slots, prefill-only and mixed 8 + prefill (four 16-position slots): the
# default-model tests' buckets (DEFAULT_MODEL_ENGINE_KW, below) and the tiny engines'.
# min_sampler_rows=16 (as in every test engine's keywords): one sampler width per engine
# instead of 3-4, each ~3 s to compile (RESULTS.md "CI time ... session 33").
FOUR_BUCKETS = dict(min_sampler_rows=16, decode_buckets=(1, 8), mixed_decode_buckets=(0, 8), prefill_buckets=((4, 16),))
TINY_ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=64,
                      max_waiting=16, page_buckets=(16,), **FOUR_BUCKETS)


@pytest.fixture(scope="module")
def tiny_engine(default_loaded):
    loaded = tiny_loaded(default_loaded.tokenizer)
    # The default-model test's four buckets (below): its sampler widths (same vocabulary)
    # come from the run's compilation cache, and the default ladder's 12 buckets and 5
    # sampler widths cost ~28 s of compiles; alone (decode 1) and batched (decode 8) still
    # run in different buckets.
    return Engine(loaded=loaded, progress=False, **TINY_ENGINE_KW)


def run_with_arrivals(eng: Engine, prompts, params, rng, prefix: str, max_per_step: int):
    """Add request i (id f"{prefix}{i}") a few at a time, 0..max_per_step before each step,
    until all are done -> ({request_id: final output}, XLA compiles meanwhile)."""
    COMPILES.count, COMPILES.active = 0, True
    try:
        outs, i = {}, 0
        while i < len(prompts) or eng.has_unfinished():
            for _ in range(int(rng.randint(0, max_per_step + 1))):
                if i < len(prompts):
                    eng.add_request(prompts[i], params[i], request_id=f"{prefix}{i}")
                    i += 1
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
        return outs, COMPILES.count
    finally:
        COMPILES.active = False


def drain(engine: Engine, ids: list[str]):
    return engine.run_until_done(ids)


def mt_bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` MT-Bench questions (../shared/data), chat-templated; on a plain clone
    without that data, the project's own questions (tests/prompt_data.py)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions()[:n]]


# Four buckets (decode 1 / 8 slots, prefill-only and mixed 8 + prefill) keep compile time
# down while a request still moves between bucket shapes; tests/test_serving_real.py uses
# the same shape so the run's compilation cache serves it. The prefill shape is four
# 16-position slots: several prompts share a step and a 64-token chunk is cut in pieces
# (engine/batch.py), both of which the token-exact test then covers.
DEFAULT_MODEL_ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                               num_pages=48, page_buckets=(32,), **FOUR_BUCKETS)


@pytest.mark.slow
def test_default_model_token_exact_under_batching(default_loaded):
    """>= 32 mixed-length prompts, arriving over time, chunked prefill (64-token budget) and
    preemption (a KV cache too small for all of them) forced: each request's greedy tokens
    (and logprobs, where asked) are the same bits as the engine's for that request alone,
    and a third of them equal the reference generator's. No compile after warm-up, no page
    leaked."""
    tok = default_loaded.tokenizer
    rng = np.random.RandomState(0)
    prompts = mt_bench_prompts(tok, 20)
    text = "\n".join(mt_bench_turns() or BUILTIN_QUESTIONS)      # plain clone: our own questions
    while len(prompts) < 36:
        n = int(rng.choice([3, 9, 40, 120, 200, 300]))
        start = int(rng.randint(0, 2000))
        ids = tok.encode(text[start:start + 4 * n])[:n]
        prompts.append(ids if len(prompts) % 3 else rng.randint(0, 49152, size=n).tolist())
    max_toks = [int(rng.choice([1, 5, 17, 24])) for _ in prompts]

    eng = Engine(loaded=default_loaded, progress=False, **DEFAULT_MODEL_ENGINE_KW)
    # every 4th request also asks for logprobs: compared bitwise with a run alone below
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2 if k % 4 == 0 else None)
              for k, m in enumerate(max_toks)]
    dispatch, prefills_per_step = eng.runner.dispatch, []

    def counting_dispatch(batch, *rest):
        prefills_per_step.append(sum(e.num_new_tokens > 1 for _, e in batch.entries))
        return dispatch(batch, *rest)

    eng.runner.dispatch = counting_dispatch
    outs, compiles = run_with_arrivals(eng, prompts, params, rng, "r", max_per_step=3)
    del eng.runner.dispatch
    assert compiles == 0, f"{compiles} compiles after warm-up"
    assert max(prefills_per_step) >= 2, "the test meant steps with several prompts packed"
    stats = eng.stats()
    assert stats["num_preemptions_total"] > 0, "the test meant to force preemption"
    assert stats["num_free_pages"] == stats["num_total_pages"], "leaked KV pages"
    assert len(outs) == len(prompts)
    # Every request alone through the same engine: the same tokens, and where logprobs were
    # asked, the same logprob and top-alternative bits (batch invariance)
    for k, prompt in enumerate(prompts):
        alone = eng.generate([prompt], params[k])[0].outputs[0]
        got = outs[f"r{k}"].outputs[0]
        assert got.token_ids == alone.token_ids, f"request {k} (prompt {len(prompt)} tokens) depends on the batch"
        assert [(x.token_id, x.logprob, x.top) for x in got.logprobs or ()] == \
               [(x.token_id, x.logprob, x.top) for x in alone.logprobs or ()], f"request {k}: logprobs depend on the batch"

    # ... and the reference generator (an implementation of its own: contiguous attention,
    # no scheduler) for a third of them and the first of each padding class; the engine's
    # copy of the weights (laid out for the CPU f32 kernel: the same bits as the loaded
    # layout, quantization.prepare_float_for_cpu; its decode steps ~40% faster). The whole
    # default model against HF under preemption: tests/test_hf_oracle.py.
    ref = ReferenceGenerator(eng.loaded.model)
    # Each request alone, padded to one of three lengths (the reference's results do not
    # depend on the padding): three prefill compiles instead of one per length, and a short
    # prompt is not computed at 512 positions; one KV cache size, so one decode compile.
    pads = (128, 256, 512)
    assert max(len(p) + m for p, m in zip(prompts, max_toks)) <= pads[-1]
    pad_of = [next(c for c in pads if c >= len(p) + m) for p, m in zip(prompts, max_toks)]
    checked = sorted({k for k in range(len(prompts)) if k % 3 == 1} | {pad_of.index(c) for c in set(pad_of)}
                     | {max(range(len(prompts)), key=lambda k: len(prompts[k]))})
    for k in checked:
        p = SamplingParams(temperature=0, max_tokens=max_toks[k], ignore_eos=True)
        want = ref.generate([prompts[k]], [p], [0], pad_to=pad_of[k], cache_len=pads[-1])[0].token_ids
        got = outs[f"r{k}"].outputs[0].token_ids
        assert got == want, f"request {k} (prompt {len(prompts[k])} tokens) differs from the reference"


def test_tiny_engine_matches_reference_with_sampling_features(tiny_engine):
    eng = tiny_engine
    ref = ReferenceGenerator(eng.loaded.model)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 49152, size=n).tolist() for n in (1, 7, 40, 100, 130)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.7),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=16, seed=123, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=5),
    ]
    outs = eng.generate(prompts, params)
    from jaxinfer.engine.sequence import derive_seed
    for prompt, p, o in zip(prompts, params, outs):
        seed = derive_seed(p.seed, 0) if p.seed is not None else 0
        want = ref.generate([prompt], [p], [seed])[0]
        assert o.outputs[0].token_ids == want.token_ids
        if p.logprobs is not None:
            got_lp = o.outputs[0].logprobs
            assert [x.token_id for x in got_lp] == [x.token_id for x in want.logprobs]
            np.testing.assert_allclose([x.logprob for x in got_lp], [x.logprob for x in want.logprobs],
                                       rtol=1e-5, atol=1e-5)
            assert all(len(x.top) == p.logprobs for x in got_lp)
    assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]


def test_logprobs_bitwise_identical_alone_and_batched(tiny_engine):
    """A request's tokens, chosen logprobs and top alternatives are the same bits alone
    (decode bucket 1) and among 14 others (bucket 8, mixed prefill steps): row reductions
    run in a fixed order (jaxinfer/reductions.py); XLA's own moved them by an ulp."""
    eng = tiny_engine
    rng = np.random.RandomState(5)
    targets = [rng.randint(3, 49152, size=n).tolist() for n in (20, 45)]
    tparams = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
               SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True, logprobs=5)]
    alone = [eng.generate([p], sp)[0].outputs[0] for p, sp in zip(targets, tparams)]
    others = [rng.randint(3, 49152, size=int(n)).tolist() for n in rng.randint(1, 120, size=14)]
    oparams = [SamplingParams(temperature=0.7 if i % 2 else 0, max_tokens=int(rng.randint(4, 40)),
                              seed=i, ignore_eos=True, logprobs=2 if i % 3 else None) for i in range(14)]
    outs = eng.generate(others[:5] + targets[:1] + others[5:11] + targets[1:] + others[11:],
                        oparams[:5] + tparams[:1] + oparams[5:11] + tparams[1:] + oparams[11:])
    for a, b in zip(alone, (outs[5].outputs[0], outs[12].outputs[0])):
        assert b.token_ids == a.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs]
    assert any(lp.top[1][1] < -1e-3 for lp in alone[0].logprobs)    # alternatives are not all 0


def test_one_sampler_for_every_bucket_and_logits_written_in_place(default_loaded):
    """By default (min_sampler_rows None) every bucket's sampler has the ladder's widest
    width, so one sampler executable serves all steps; the forwards write their rows into
    the width's logits buffer in place (the same memory every step: no [rows, V] copy),
    and a step's padding rows hold an earlier step's logits, which change nothing: a
    request alone before and after a batched run, and inside it, gets the same bits."""
    kw = {k: v for k, v in TINY_ENGINE_KW.items() if k != "min_sampler_rows"}
    eng = Engine(loaded=tiny_loaded(default_loaded.tokenizer), progress=False, **kw)
    assert eng.config.min_sampler_rows is None
    assert {b.sample_rows for b in eng.ladders.all_buckets()} == {16}       # 8 decodes + 4 prefill slots
    r = eng.runner
    assert set(r.samplers) == {16} and set(r.logits_bufs) == {16}
    where = r.logits_bufs[16].unsafe_buffer_pointer()
    rng = np.random.RandomState(11)
    target = rng.randint(3, 49152, size=30).tolist()
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3)
    bits = lambda o: [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]  # noqa: E731
    before = eng.generate([target], sp)[0].outputs[0]
    others = [rng.randint(3, 49152, size=int(n)).tolist() for n in rng.randint(5, 60, size=7)]
    batched = eng.generate(others + [target], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 7
                           + [sp])[-1].outputs[0]
    after = eng.generate([target], sp)[0].outputs[0]
    assert bits(before) == bits(batched) == bits(after)
    assert r.logits_bufs[16].unsafe_buffer_pointer() == where
    assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]


def test_seeded_sampling_reproducible_and_n_samples_differ(tiny_engine):
    # A high temperature: the tiny model's tied, scaled embedding favours repeating its input.
    p = SamplingParams(temperature=4.0, max_tokens=12, seed=42, n=3, ignore_eos=True)
    a = tiny_engine.generate([[5, 6, 7, 8] * 10], p)[0]
    b = tiny_engine.generate([[5, 6, 7, 8] * 10], p)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1, "n=3 samples should differ"
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_stop_strings_cut_exactly(tiny_engine):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = tiny_engine.generate("Once upon a time", p)[0].outputs[0].text
    assert len(full) > 8
    stop = full[5:8]
    cut = tiny_engine.generate("Once upon a time", p.replace(stop=(stop,)))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]
    keep = tiny_engine.generate("Once upon a time", p.replace(stop=(stop,), include_stop_str_in_output=True))
    assert keep[0].outputs[0].text == full[:full.index(stop) + len(stop)]


def test_abort_frees_pages_at_once(tiny_engine):
    eng = tiny_engine
    rid = eng.add_request(list(range(10, 90)), SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats()["num_free_pages"] < eng.stats()["num_total_pages"]
    assert eng.abort(rid)
    assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]
    assert not eng.has_unfinished()


def test_limits_and_bad_input(tiny_engine):
    eng = tiny_engine
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(300)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token id"):
        eng.add_request([1, 10**9], SamplingParams())
    # (a request needing more pages than the whole cache: tests/test_scheduler.py)
    ids = []
    with pytest.raises(QueueFullError):
        for i in range(40):
            ids.append(eng.add_request([1, 2, 3], SamplingParams(max_tokens=2)))
    for rid in ids:
        eng.abort(rid)
    assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]


def stream_through_async_engine(engine: Engine, prompts: list[str], params: SamplingParams):
    """Each prompt through an AsyncEngine over ``engine``, concurrently -> [(final output,
    [token ids of every update])] (the updates are cumulative and grow in place: copied)."""
    from jaxinfer.engine.async_engine import AsyncEngine

    aeng = AsyncEngine(engine)

    async def one(prompt, rid):
        seen = []
        async for out in aeng.generate(prompt, params, rid):
            seen.append(list(out.outputs[0].token_ids))
        return out, seen

    async def main():
        res = await asyncio.gather(*(one(p, f"stream{i}") for i, p in enumerate(prompts)))
        await aeng.shutdown()
        return res

    return asyncio.run(main())


def test_async_engine_streams_and_matches_generate(tiny_engine):
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["Hello there", "General Kenobi"]
    want = tiny_engine.generate(prompts, p)
    for (final, seen), w in zip(stream_through_async_engine(tiny_engine, prompts, p), want):
        assert final.finished and final.outputs[0].token_ids == w.outputs[0].token_ids
        assert all(seen[i + 1][:len(seen[i])] == seen[i] for i in range(len(seen) - 1))


def test_ladder_without_room_for_a_mixed_step_is_refused(default_loaded):
    """A prompt's chunks run beside up to max_num_seqs - 1 decodes: a mixed-decode ladder
    that cannot hold them is refused when the engine is built (it used to fail mid-run with
    "decode slots: 2 exceeds the largest bucket (0)")."""
    loaded = tiny_loaded(default_loaded.tokenizer)
    for mixed in ((0,), (0, 2)):
        with pytest.raises(ValueError, match=r"mixed_decode_buckets: the largest .*max_num_seqs - 1 = 3"):
            Engine(loaded=loaded, progress=False, max_num_seqs=4, num_pages=16, mixed_decode_buckets=mixed)

"""Beam search (jaxinfer/engine/beam.py) against HF transformers ``generate(num_beams=...)``.

Two levels: the search alone (``BeamState`` fed the HF model's own top-20 log-probabilities
per beam: the selection, hypotheses, length penalty and stopping rules must reproduce
HF's sequences and scores exactly), and the engine (beams as sequences in the paged cache,
forked copy-on-write, batched with ordinary requests): the same sequences and scores as
HF on the same weights, alone and batched, and no page left held.

The stop token of each case is one the model likes (a token of its greedy output), so
hypotheses end on it and the finished-beam paths run; lengths, penalties and all three
``early_stopping`` modes vary.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch
import transformers

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.beam import BeamState, check_width  # noqa: E402
from test_hf_oracle import TINY  # noqa: E402

PROMPT = [1, 50, 60, 70, 80]
MAX_NEW = 12
# (index of the greedy output token used as the stop token(s), width, length_penalty,
# early_stopping, whether a returned hypothesis ends on a stop token: a guard that the
# finished-hypothesis paths ran, not a result)
CASES = [((3,), 4, 1.0, False, False), ((2,), 4, 0.5, True, True), ((4,), 3, 2.0, "never", False),
         ((), 4, 1.0, False, False), ((3, 5), 4, -1.0, False, True), ((1,), 2, 0.0, "never", True)]


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def hf_greedy(m, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_beams(m, prompt: list[int], stop: list[int], width: int, lp: float, es, max_new: int, n: int):
    """HF's n best (generated tokens cut after the stop token, sequence score)."""
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                         max_new_tokens=max_new, do_sample=False, length_penalty=lp, early_stopping=es,
                         eos_token_id=stop or None, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    res = []
    for toks, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        cut = next((i + 1 for i, t in enumerate(toks) if t in stop), len(toks))
        res.append((toks[:cut], score))
    return res


def search_on_hf_logits(m, prompt: list[int], stop: list[int], width: int, lp: float, es, max_new: int):
    st = BeamState(width, lp, es, frozenset(stop), max_new)
    beams: list[tuple[int, ...]] = [()]
    while not st.done:
        tops = []
        for b in beams:
            with torch.no_grad():
                logits = m(torch.tensor([prompt + list(b)])).logits[0, -1].float()
            v, i = torch.topk(torch.log_softmax(logits, -1), SamplingParams.MAX_LOGPROBS)
            tops.append((i.numpy(), v.numpy()))
        beams = [beams[c.beam] + (c.token,) for c in st.step(list(beams), tops)]
    return [(list(h.token_ids), h.score) for h in st.finished]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stop{len(c[0])}-w{c[1]}-lp{c[2]}-{c[3]}")
def test_search_matches_hf_on_hf_logits(hf_model, case):
    idx, width, lp, es, ends_on_stop = case
    greedy = hf_greedy(hf_model, PROMPT, 8)
    stop = [greedy[i] for i in idx]
    ours = search_on_hf_logits(hf_model, PROMPT, stop, width, lp, es, MAX_NEW)
    want = hf_beams(hf_model, PROMPT, stop, width, lp, es, MAX_NEW, width)
    assert [t for t, _ in ours] == [t for t, _ in want]
    np.testing.assert_allclose([s for _, s in ours], [s for _, s in want], rtol=1e-5, atol=1e-5)
    assert any(t[-1] in stop for t, _ in ours) == ends_on_stop


def test_width_and_combinations_refused_clearly():
    with pytest.raises(ValueError, match="beam_width"):
        check_width(SamplingParams(beam_width=8, temperature=0), num_stop_tokens=2)   # 3 * 8 > 20
    check_width(SamplingParams(beam_width=10, temperature=0), num_stop_tokens=1)
    for kw, field in [(dict(temperature=1.0), "temperature"), (dict(top_p=0.5), "top_p"),
                      (dict(repetition_penalty=1.2), "repetition_penalty"), (dict(logprobs=2), "logprobs"),
                      (dict(stop=["x"]), "stop"), (dict(guided={"regex": "a+"}), "guided"),
                      (dict(watermark=True), "watermark"), (dict(n=5), "n"), (dict(beam_width=11), "beam_width"),
                      (dict(early_stopping="always"), "early_stopping")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**{"beam_width": 4, "temperature": 0, **kw})


# ----------------------------------------------------------------------------- engine

ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, num_pages=64, page_size=8,
                 min_sampler_rows=16, decode_buckets=(1, 4, 8), mixed_decode_buckets=(0, 8), prefill_buckets=((1, 16),),
                 page_buckets=(8,))


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from test_hf_oracle import FAMILIES, build_family

    path = str(tmp_path_factory.mktemp("beam-llama"))
    hf = build_family(next(f for f in FAMILIES if f.name == "llama"), path)
    return hf, Engine(loaded=load_model(path, "float32"), progress=False, **ENGINE_KW), path


def engine_params(stop: list[int], width: int, lp: float, es) -> SamplingParams:
    # the stop tokens are exactly HF's eos_token_id list
    return SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=MAX_NEW, length_penalty=lp,
                          early_stopping=es, stop_token_ids=tuple(stop), ignore_eos=True)


def compare(out, want) -> list[str]:
    errs = []
    if [o.token_ids for o in out.outputs] != [t for t, _ in want]:
        errs.append(f"sequences {[o.token_ids for o in out.outputs]} != HF {[t for t, _ in want]}")
    for o, (_, s) in zip(out.outputs, want):
        if abs(o.beam_score - s) > 1e-4:
            errs.append(f"score {o.beam_score} != HF {s}")
    return errs


def test_engine_matches_hf_alone_and_batched_no_leak(tiny_engine):
    from test_engine import COMPILES

    hf, eng, _ = tiny_engine
    prompts = [PROMPT, [1, 7, 99, 150, 3, 42, 42, 250, 19]]
    runs = []
    for prompt in prompts:
        greedy = hf_greedy(hf, prompt, 8)
        for idx, width, lp, es, _ in CASES:
            stop = [greedy[i] for i in idx]
            runs.append((prompt, engine_params(stop, width, lp, es),
                         hf_beams(hf, prompt, stop, width, lp, es, MAX_NEW, width)))
    alone = [eng.generate([p], sp)[0] for p, sp, _ in runs]
    errors = [f"{i}: {e}" for i, ((_, _, want), out) in enumerate(zip(runs, alone)) for e in compare(out, want)]
    assert not errors, "\n".join(errors)
    assert any(o.finish_reason == "stop" for out in alone for o in out.outputs)
    COMPILES.active = True
    try:
        # every search at once (they wait for their reserved places) among plain requests
        plain = SamplingParams(max_tokens=10, temperature=0.7, seed=5)
        batched = eng.generate([p for p, _, _ in runs] + prompts, [sp for _, sp, _ in runs] + [plain] * 2)
    finally:
        COMPILES.active = False
    assert COMPILES.count == 0
    for a, b in zip(alone, batched):
        assert [(o.token_ids, o.beam_score, o.cumulative_logprob) for o in a.outputs] == \
               [(o.token_ids, o.beam_score, o.cumulative_logprob) for o in b.outputs]
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages
    assert eng.runner.page_mover.pages_copied > 0      # forks copied partial pages


def test_engine_beam_search_survives_preemption(tiny_engine):
    """A KV pool too small for all beams at once: beams are preempted and recomputed, and
    the result is still HF's."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    hf, _, path = tiny_engine
    # 7 + 12 tokens (no stop token: every search runs to the length limit): up to 3 pages
    # a beam, the first shared, so two searches need 18 of the 12 pages; forks find no
    # free page for their copy and wait to recompute
    small = Engine(loaded=load_model(path, "float32"), progress=False, **dict(ENGINE_KW, num_pages=13))
    prompt = PROMPT + [90, 91]
    stop: list[int] = []
    want = hf_beams(hf, prompt, stop, 4, 1.0, False, MAX_NEW, 4)
    outs = small.generate([prompt] * 3, engine_params(stop, 4, 1.0, False))
    assert small.stats()["num_preemptions_total"] > 0
    for out in outs:
        assert not compare(out, want)
    small.block_manager.check_invariants()
    assert small.block_manager.num_free_pages == small.block_manager.num_usable_pages


@pytest.mark.slow
def test_default_model_matches_hf_alone_and_batched():
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from test_default_model import hf_default_model
    from test_engine import DEFAULT_MODEL_ENGINE_KW

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is the capital of France?", "Name three colors.")]
    # test_engine's shapes for the default model: the run's compilation cache serves both
    eng = Engine(loaded=loaded, progress=False, **DEFAULT_MODEL_ENGINE_KW)
    hf = hf_default_model()
    stop = list(eng.eos_token_ids)
    cases = [(4, 1.0, True), (4, 0.8, False)]
    runs = [(p, SamplingParams(beam_width=w, n=w, temperature=0, max_tokens=16, length_penalty=lp,
                               early_stopping=es, stop_token_ids=tuple(stop), ignore_eos=True),
             hf_beams(hf, p, stop, w, lp, es, 16, w)) for p in prompts for w, lp, es in cases]
    alone = [eng.generate([p], sp)[0] for p, sp, _ in runs]
    errors = [f"{i}: {e}" for i, ((_, _, want), out) in enumerate(zip(runs, alone)) for e in compare(out, want)]
    assert not errors, "\n".join(errors)
    batched = eng.generate([p for p, _, _ in runs], [sp for _, sp, _ in runs])
    for a, b in zip(alone, batched):
        assert [(o.token_ids, o.beam_score) for o in a.outputs] == [(o.token_ids, o.beam_score) for o in b.outputs]
    assert eng.block_manager.num_free_pages == eng.block_manager.num_usable_pages

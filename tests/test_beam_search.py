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

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxinfer.config import SamplingParams  # noqa: E402
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

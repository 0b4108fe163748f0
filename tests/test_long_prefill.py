"""A long prompt does not stall the requests sent beside it (issue #51, "one 10 KB request
stalls everyone"): the real engine on a tiny random model, a prompt of 3.75x the token budget
prefilling, three short requests added after its first step all finish before its first
token, with the same tokens and logprob bits as each alone (batch invariance: the capped
chunks change how the long prompt is cut, never what anyone computes). With the cap off,
the short ones wait for the whole prefill: the ordering is the cap's doing.

The engine steps here by hand (``Engine.step``), so the test asserts the order of events,
not wall-clock windows. The scheduler's own rules (cap only when shared, progress every
step, whole prefill slots) are tests/test_scheduler.py's."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxinfer.engine.engine import Engine
from jaxinfer.loading import LoadedModel
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.sampling_params import SamplingParams

# tests/test_engine.py's tiny engines' keywords (their executables come from the session's
# compilation cache): a 64-token budget in four 16-position prefill slots, so a capped chunk
# (the auto threshold 64 // 16 = 4, rounded up to one 16-position slot) and the full budget
# are both compiled shapes.
ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=64,
                 max_waiting=16, page_buckets=(16,), min_sampler_rows=16, decode_buckets=(1, 8),
                 mixed_decode_buckets=(0, 8), prefill_buckets=((4, 16),))
LONG = 240                              # prompt tokens: 3.75 budgets, 15 capped chunks
SHORT_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
LONG_PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def engine():
    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_reader(open_gguf(default_model_path()))   # CI installs it: fail if absent
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_ids=(2,))
    loaded = LoadedModel(cfg, LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tok, {}, "tiny-random-llama")
    return Engine(loaded=loaded, progress=False, **ENGINE_KW)


def prompts() -> tuple[list[int], list[list[int]]]:
    rng = np.random.RandomState(51)
    return (rng.randint(3, 49152, size=LONG).tolist(),
            [rng.randint(3, 49152, size=n).tolist() for n in (5, 9, 14)])


def run_beside(eng: Engine) -> tuple[dict, dict[str, int], int]:
    """The long prompt alone for one step, then the short ones -> (final outputs by id, the
    step each short one finished at, the step the long one got its first token at)."""
    long, shorts = prompts()
    long_id = eng.add_request(long, LONG_PARAMS)
    outs, done_at, first_at = {}, {}, None
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == long_id and first_at is None and o.outputs[0].token_ids:
                first_at = step
            if o.finished:
                outs[o.request_id] = o
                done_at[o.request_id] = step
        if step == 0:
            short_ids = [eng.add_request(p, SHORT_PARAMS) for p in shorts]
        step += 1
    outs["long"], done = outs.pop(long_id), {f"short{i}": done_at[r] for i, r in enumerate(short_ids)}
    for i, r in enumerate(short_ids):
        outs[f"short{i}"] = outs.pop(r)
    return outs, done, first_at


def tokens_and_logprobs(o) -> tuple[list[int], list]:
    c = o.outputs[0]
    return c.token_ids, [(x.token_id, x.logprob, x.top) for x in c.logprobs or ()]


def test_short_requests_finish_before_a_long_prefill_with_their_tokens_alone(engine):
    outs, done, long_first = run_beside(engine)
    assert max(done.values()) < long_first, (done, long_first)
    long, shorts = prompts()
    for i, p in enumerate(shorts):
        alone = engine.generate([p], SHORT_PARAMS)[0]
        assert tokens_and_logprobs(outs[f"short{i}"]) == tokens_and_logprobs(alone), f"short{i}"
    assert tokens_and_logprobs(outs["long"]) == tokens_and_logprobs(engine.generate([long], LONG_PARAMS)[0])
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_without_the_cap_the_short_requests_wait_for_the_whole_prefill(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "long_prefill_cap", 0)
    _, done, long_first = run_beside(engine)
    assert min(done.values()) > long_first, (done, long_first)

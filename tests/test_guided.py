"""Constrained decoding (jaxinfer/engine/guided.py + the sampler's token mask) on a tiny
random-weight model with the default model's real tokenizer (49,152 tokens).

Every output of 54 JSON schemas parses and validates with ``jsonschema``, greedy and
sampled, batched with unconstrained requests whose tokens stay identical to a run without
them; regex, choice, Lark grammars likewise; logit_bias, min_tokens, bad words; library
errors surface as ValueError; nothing compiles after warm-up.

The model is random, so nothing steers it to close a string or a number: a logit bias on
the closing tokens (``"``, ``}``, ``]``, ``,`` and their combinations) makes outputs end
within max_tokens. The mask still decides every token (a bias never lifts a masked one).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import jsonschema
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from guided_schemas import SCHEMAS  # noqa: E402
from test_engine import COMPILES, TINY_ENGINE_KW, tiny_loaded  # noqa: E402

from jaxinfer.sampling_params import MAX_SPEC_CHARS, SamplingParams  # noqa: E402
from jaxinfer.engine import guided as G  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402

PLAIN = SamplingParams(temperature=0, max_tokens=16)
NEIGHBOURS = ["Hello there", "Once upon"]


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    import gguf

    from jaxinfer.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf_reader(gguf.GGUFReader(default_gguf_path))


@pytest.fixture(scope="module")
def eng(tok):
    loaded = tiny_loaded(tok)
    # Flatten the logits (tiny_loaded sharpens them 40x) so a small bias on the closing
    # tokens ends strings and numbers, and sampling explores many allowed tokens.
    loaded.model.embed.set_value(loaded.model.embed[...] * 0.01)
    loaded.model.lm_head.set_value(loaded.model.lm_head[...] * 0.01)
    # tests/test_engine.py's tiny engine shape: the session's compilation cache serves it
    return Engine(loaded=loaded, progress=False, **TINY_ENGINE_KW)


@pytest.fixture(scope="module")
def closers(tok):
    """Bias for tokens made only of ``"}],`` (a leading quote a bit more, a lone comma less)."""
    out = {}
    for i in range(tok.vocab_size):
        s = tok.decode([i])
        if s and set(s) <= set('"}],'):
            out[i] = 6.0 + (2.0 if s[0] == '"' else 0.0) - (4.0 if s == "," else 0.0)
    assert len(out) > 10
    return out


@pytest.fixture(scope="module")
def baseline(eng):
    return [o.outputs[0].token_ids for o in eng.generate(NEIGHBOURS, PLAIN)]


def run_batch(eng, baseline, params):
    """The constrained requests batched with the unconstrained neighbours, whose tokens
    must be those of the run without them; no compile meanwhile."""
    COMPILES.count, COMPILES.active = 0, True
    try:
        outs = eng.generate(NEIGHBOURS + ["Reply in JSON:"] * len(params), [PLAIN, PLAIN] + params)
    finally:
        COMPILES.active = False
    assert [o.outputs[0].token_ids for o in outs[:2]] == baseline
    assert COMPILES.count == 0
    return [o.outputs[0] for o in outs[2:]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_outputs_validate(eng, baseline, closers, temperature):
    assert len(SCHEMAS) >= 50
    bad = []
    for k in range(0, len(SCHEMAS), 6):
        chunk = SCHEMAS[k:k + 6]
        params = [SamplingParams(temperature=temperature, seed=k + i, max_tokens=160, guided={"json": s},
                                 logit_bias=closers) for i, s in enumerate(chunk)]
        for s, o in zip(chunk, run_batch(eng, baseline, params)):
            try:
                jsonschema.validate(json.loads(o.text), s)
                assert o.finish_reason == "stop"
            except (ValueError, AssertionError, jsonschema.ValidationError) as e:
                bad.append((s, o.text, o.finish_reason, str(e)[:200]))
    assert not bad, bad
    assert not eng.has_unfinished() and eng.block_manager.num_free_pages == eng.block_manager.num_usable_pages


def test_json_object_regex_choice_grammar(eng, baseline, closers):
    regexes = [r"\d{3}-[a-z]{2,4}", r"(yes|no|maybe) because [a-z]{1,10}\.", r"[A-Z][a-z]{2,8} [0-9]{1,3}"]
    choices = ["alpha", "beta", "gamma delta", "épsilon"]
    lark = 'start: "SELECT " col " FROM " tbl\ncol: "a" | "b" | "*"\ntbl: /[a-z]{2,6}/'
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1, max_tokens=40, guided={"regex": r})
                  for r in regexes]
        params += [SamplingParams(temperature=temperature, seed=2, max_tokens=40, guided={"choice": choices}),
                   SamplingParams(temperature=temperature, seed=3, max_tokens=40, guided={"grammar": lark}),
                   SamplingParams(temperature=temperature, seed=4, max_tokens=120, guided={"json_object": True},
                                  logit_bias=closers)]
        outs = run_batch(eng, baseline, params)
        for r, o in zip(regexes, outs):
            assert re.fullmatch(r, o.text), (r, o.text)
        assert outs[3].text in choices
        assert re.fullmatch(r"SELECT (a|b|\*) FROM [a-z]{2,6}", outs[4].text), outs[4].text
        assert isinstance(json.loads(outs[5].text), dict)
        assert all(o.finish_reason == "stop" for o in outs)


def test_n_samples_each_follow_the_grammar(eng):
    out = eng.generate("Pick:", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20,
                                               guided={"choice": ["red", "green", "blue", "cyan"]}))[0]
    assert all(o.text in ("red", "green", "blue", "cyan") for o in out.outputs)


def test_logit_bias_min_tokens_bad_words(eng, baseline, tok):
    eos = eng.eos_token_ids[0]
    first = baseline[0][0]
    bias_up, bias_ban, min_tok, bad = run_batch(eng, baseline, [
        PLAIN.replace(logit_bias={123: 100}),                  # one token dominates
        PLAIN.replace(logit_bias={first: -100}),               # the greedy first token is banned
        PLAIN.replace(logit_bias={eos: 100}, min_tokens=5),    # EOS wins once allowed
        PLAIN.replace(bad_words=[tok.decode(baseline[0][:1]).strip()]),
    ])
    assert bias_up.token_ids == [123] * 16
    assert first not in bias_ban.token_ids
    assert len(min_tok.token_ids) == 6
    assert min_tok.token_ids[-1] == eos and eos not in min_tok.token_ids[:5] and min_tok.finish_reason == "stop"
    words = G.bad_word_sequences(tok, [tok.decode(baseline[0][:1]).strip()])
    ids = bad.token_ids
    for w in words:
        assert not any(tuple(ids[i:i + len(w)]) == w for i in range(len(ids))), (w, ids)


@pytest.mark.parametrize("guided, needle", [
    ({"json": {"type": "foo"}}, "Invalid type"),
    ({"json": {"type": "object", "dependentSchemas": {"a": {}}}}, "Unimplemented keys"),
    ({"json": {"$ref": "http://example.com/s.json"}}, "http://example.com/s.json"),
    ({"json": '{"type": '}, "not valid JSON"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": "start: foo\n"}, "foo"),
    ({"choice": []}, "non-empty"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "over the limit"),
])
def test_invalid_grammars_are_refused_with_the_library_message(eng, guided, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        eng.add_request("x", SamplingParams(guided=guided, max_tokens=4))
    assert not eng.has_unfinished()


def test_bad_constraint_values():
    for kw, field in [({"logit_bias": {1: 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"min_tokens": 20}, "min_tokens"), ({"bad_words": [""]}, "bad_words"),
                      ({"guided": {"xml": "a"}}, "guided")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_tokens=16, **kw)


def test_grammar_cache_compiles_each_text_once(eng):
    g = eng.grammars
    before = g.compiled
    for _ in range(3):
        eng.generate("x", SamplingParams(temperature=0, max_tokens=3, guided={"regex": "[0-9]{3}"}))
    assert g.compiled == before + 1


def test_add_request_waits_at_most_the_compile_time_budget(eng, monkeypatch):
    """In process, add_request compiles in the compiler's threads and gives up after its
    time budget (a ValueError naming it, nothing queued); the compile goes on and lands in
    the cache, so the same grammar is then accepted at once."""
    release, threads = threading.Event(), []
    build = G.GrammarCompiler._build

    def held(compiler, spec):
        threads.append(threading.current_thread().name)
        release.wait(30)
        return build(compiler, spec)
    monkeypatch.setattr(G.GrammarCompiler, "_build", held)
    monkeypatch.setattr(eng.grammars, "time_budget", 0.3)
    params = SamplingParams(temperature=0, max_tokens=3, guided={"regex": "[0-9]{2}x"})
    before = eng.grammars.compiled
    try:
        with pytest.raises(ValueError, match=re.escape("did not compile within the time budget of 0.3 s")):
            eng.add_request("x", params)
        # it returned while the compile is still held: nothing compiled, nothing queued
        assert eng.grammars.compiled == before and not eng.has_unfinished()
    finally:
        release.set()
    assert threads[0].startswith("jaxinfer-grammar")         # not the caller's thread
    deadline = time.monotonic() + 30
    while eng.grammars.compiled == before and time.monotonic() < deadline:
        time.sleep(0.05)
    out = eng.generate("x", params)[0].outputs[0]
    assert re.fullmatch("[0-9]{2}x", out.text) and len(threads) == 1


def test_parser_limits_bound_each_compile_and_each_step(eng, tok, monkeypatch):
    """llguidance's limits are applied: a grammar over the size limit is refused with a
    message naming it; a mask over the step's lexer fuel allows only EOS and the sequence
    stops with the library's reason, instead of the step running on."""
    V = eng.model_config.vocab_size
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,9}x"} for i in range(30)}}
    spec = G.GuidedDecoding.parse({"json": schema})
    monkeypatch.setitem(G.PARSER_LIMITS, "max_grammar_size", 100)
    with pytest.raises(G.GuidedDecodingError, match=re.escape("too big (limit for this grammar: 100)")):
        G.GrammarCompiler(tok, V, eng.eos_token_ids).compile(spec)
    monkeypatch.setitem(G.PARSER_LIMITS, "max_grammar_size", 100_000)
    monkeypatch.setitem(G.PARSER_LIMITS, "step_lexer_fuel", 100)
    c = G.SequenceConstraints(G.GrammarCompiler(tok, V, eng.eos_token_ids).matcher(spec), 0, [], [], [])
    eos = eng.eos_token_ids[0]
    for t in tok.encode('{"p0": "abcx", "p1": "abcx", "p2": "', add_special_tokens=False):
        row = np.full(G.mask_width(V), -1, np.int32)
        c.fill(row, [])
        if _zeros(row, V) == set(range(V)) - {eos}:
            break
        assert t not in _zeros(row, V)
        c.advance(t)
    else:
        pytest.fail("the step fuel limit never took effect")
    c.advance(eos)
    assert c.stopped and "too many expressions" in c.error


def test_mask_rows_host_side():
    class _Stub:
        def __init__(self):
            self.fed = []

    v = 70                                            # not a multiple of 32: tail bits stay 0
    c = G.SequenceConstraints(None, min_tokens=2, min_tokens_ids=[3, 65],
                              bad_words=[(9,), (4, 5)], bias=[(7, 2.5)])
    m = G.build_mask(3, v, [(1, c, [4], ())])
    allowed = np.unpackbits(m.bits.view(np.uint8), bitorder="little").reshape(3, -1)
    assert allowed[0].sum() == 96 and not m.active[0]       # untouched rows: all ones, inactive
    row = allowed[1]
    assert m.active[1] and row[v:].sum() == 0
    assert {3, 65, 9, 5} == set(np.flatnonzero(row[:v] == 0))
    assert m.bias_ids[1, 0] == 7 and m.bias_vals[1, 0] == 2.5 and m.bias_vals[1, 1:].sum() == 0
    m2 = G.build_mask(3, v, [(1, c, [4, 1], ())])                # min_tokens reached, 4 5 no longer pending
    assert set(np.flatnonzero(np.unpackbits(m2.bits[1].view(np.uint8), bitorder="little")[:v] == 0)) == {9}


def _zeros(bits_row: np.ndarray, v: int) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bits_row.view(np.uint8), bitorder="little")[:v] == 0).tolist())


def test_draft_rows_are_the_rows_after_each_draft_prefix(eng, tok):
    """Speculative verification: slot j of a draft gets the mask plain decoding would use
    after the first j draft tokens (min_tokens, bad words, the grammar's state), bias on
    every slot; the matcher is left as it was; a draft is cut where its grammar refuses it
    or completes."""
    v = 70
    c = G.SequenceConstraints(None, min_tokens=2, min_tokens_ids=[3, 65], bad_words=[(9,), (4, 5)], bias=[(7, 2.5)])
    m = G.build_mask(5, v, [(1, c, [], (4, 1))])
    assert [_zeros(m.bits[i], v) for i in (1, 2, 3)] == [{3, 65, 9}, {3, 65, 9, 5}, {9}]
    assert m.active.tolist() == [False, True, True, True, False]
    assert (m.bias_ids[1:4, 0] == 7).all() and m.bias_ids[4, 0] == 0

    V = eng.model_config.vocab_size
    grammars = G.GrammarCompiler(tok, V, eng.eos_token_ids)
    spec = G.GuidedDecoding.parse({"regex": r"[0-9]{3}-[a-z]{2}"})
    ids = tok.encode("123-ab", add_special_tokens=False)
    assert len(ids) >= 3
    c = G.SequenceConstraints(grammars.matcher(spec), 0, [], [], [])
    before = np.full(G.mask_width(V), -1, np.int32)
    c.fill(before, [])
    assert c.valid_prefix(ids) == len(ids)
    assert c.valid_prefix(ids[:1] + tok.encode("x", add_special_tokens=False)) == 1
    m = G.build_mask(len(ids) + 2, V, [(1, c, [], tuple(ids))])
    ref = G.SequenceConstraints(grammars.matcher(spec), 0, [], [], [])
    for j in range(len(ids) + 1):
        want = np.full(G.mask_width(V), -1, np.int32)
        ref.fill(want, [])
        assert (m.bits[1 + j] == want).all(), j
        if j < len(ids):
            ref.advance(ids[j])
    assert ref.stopped                     # "123-ab" completes the regex ...
    assert c.valid_prefix(ids + ids) == len(ids)    # ... so a draft past it is cut there
    after = np.full(G.mask_width(V), -1, np.int32)
    c.fill(after, [])
    assert (after == before).all()         # the matcher is where it was


@pytest.fixture(scope="module", params=["ngram", "tree", "self"])
def spec_pair(request, tok):
    """A sharp tiny model (greedy outputs fall into loops, so drafts are accepted) without
    and with speculation ("tree": prompt lookup's two likeliest candidates at once)."""
    loaded = tiny_loaded(tok)
    opts = {"ngram": dict(speculative_method="ngram", ngram_prompt_lookup_min=1),
            "tree": dict(speculative_method="ngram", ngram_prompt_lookup_min=1, speculative_tree_width=2),
            "self": dict(speculative_method="self", speculative_draft_layers=1)}[request.param]
    opts["num_speculative_tokens"] = 3
    return Engine(loaded=loaded, progress=False, **TINY_ENGINE_KW), \
        Engine(loaded=loaded, progress=False, **TINY_ENGINE_KW, **opts)


def test_constrained_requests_speculate_with_the_plain_tokens(spec_pair, closers):
    """Grammar (JSON schema, regex, choice, Lark), logit_bias, min_tokens and bad words
    with speculation: the tokens (and logprobs) of decoding without it, alone and batched;
    drafts were verified and accepted under the masks; no compile, no page leaked."""
    plain, spec = spec_pair
    params = [SamplingParams(temperature=0, max_tokens=48, guided={"json": SCHEMAS[k]}, logprobs=1)
              for k in (0, 5, 11)]
    params += [SamplingParams(temperature=0, max_tokens=40, guided={"regex": r"[a-z ]{4,60}\."}),
               SamplingParams(temperature=0, max_tokens=40, guided={"regex": r"(ab|cd|[0-9]{2}){3,30}"}),
               SamplingParams(temperature=0, max_tokens=12, guided={"choice": ["alpha beta gamma", "delta"]}),
               SamplingParams(temperature=0, max_tokens=40, guided={"grammar": 'start: ("x" | "yz" | " ")+'}),
               SamplingParams(temperature=0, max_tokens=32, logit_bias={k: 3.0 for k in list(closers)[:5]},
                              min_tokens=6, bad_words=["the"]),
               SamplingParams(temperature=0.9, seed=3, max_tokens=32, guided={"regex": r"[a-z]{1,40}"})]
    prompts = ["Reply in JSON:", "Write:", "Numbers and letters:"] * 3
    # prompt lookup proposes the prompt's pattern, which the model leaves: drafts rejected
    params += [SamplingParams(temperature=0, max_tokens=40, guided={"regex": r"((ab|cd|ef) ){3,30}"})]
    prompts += ["ab cd ab cd ab cd"]
    want = plain.generate(prompts, params)
    s0 = spec.stats()
    COMPILES.count, COMPILES.active = 0, True
    try:
        alone = [spec.generate([p], sp)[0] for p, sp in zip(prompts, params)]
        batched = spec.generate(prompts, params)
    finally:
        COMPILES.active = False
    assert COMPILES.count == 0
    for w, a, b in zip(want, alone, batched):
        assert a.outputs[0].token_ids == w.outputs[0].token_ids == b.outputs[0].token_ids, w.outputs[0].text
        assert a.outputs[0].logprobs == w.outputs[0].logprobs
    st = spec.stats()
    assert st["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"] > 40
    if spec.config.speculative_method == "ngram":     # ('self' on this tiny model agrees always)
        assert spec.config.speculative_tree_width == 1 or spec.speculator.tree.num_branches > 0
        assert st["spec_decode_num_draft_tokens"] > st["spec_decode_num_accepted_tokens"]
    assert not spec.has_unfinished() and spec.block_manager.num_free_pages == spec.block_manager.num_usable_pages

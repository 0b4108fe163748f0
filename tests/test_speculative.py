"""Speculative decoding (engine/speculative.py, engine/spec_draft.py), for every method —
prompt lookup ("ngram"), the target's own quantized first layer ("self") and a separate
smaller model sharing the vocabulary ("draft"): drafts verified in one ragged step must
give exactly the plain engine's tokens (greedy, seeded sampling, logprobs), stop where the
plain engine stops (stop token or max_tokens in the middle of an accepted run), survive
preemption, compile nothing after warm-up and leak no page; at temperature > 0 with
fresh seeds the token distribution must be the target's (chi-square).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter

import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxinfer.engine_config import EngineConfig
from jaxinfer.models.config import ModelConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import make_sequences
from jaxinfer.engine.speculative import NgramProposer
from jaxinfer.loading import LoadedModel
from jaxinfer.models.llama import LlamaForCausalLM

from test_engine import run_with_arrivals

V = 64
K = 3
KW = dict(progress=False, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_pages=40,
          max_waiting=64, min_sampler_rows=16, decode_buckets=(1, 4, 16), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 64),),
          debug_poison_freed_pages=True)
COMMON = dict(num_speculative_tokens=K, speculative_disable_by_batch_size=4)     # batches of 4 speculate too
METHODS = ("ngram", "self", "draft", "tree")


def _tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    cfg = ModelConfig(**{**dict(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=64,
                                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,)),
                         **overrides})
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def tiny():
    from jaxinfer.loading import load_model

    tok = load_model(None, "float32").tokenizer
    model = _tiny_llama(3)
    emb = model.embed[...] * 6.0      # peaked enough that greedy outputs fall into cycles
    model.embed.set_value(emb)
    # a permuted head: the likeliest next token is a fixed function of the last one, so
    # greedy outputs cycle through several tokens (not one token repeated)
    model.lm_head.set_value(emb[np.random.RandomState(0).permutation(V)].T)
    return LoadedModel(model.cfg, model, tok, {}, "tiny-random-llama-v64")


def save_hf_dir(model: LlamaForCausalLM, tokenizer, out) -> str:
    """``model`` as an HF checkpoint directory (config.json, model.safetensors, tokenizer)."""
    from safetensors.numpy import save_file

    from jaxinfer.models.base import get_param
    from jaxinfer.models.registry import weight_specs

    c = model.cfg
    tensors = {}
    for path, spec in weight_specs(c).items():
        w = np.asarray(get_param(model, path)[...])
        tensors[spec.hf_name] = np.ascontiguousarray(w.swapaxes(-1, -2) if spec.transpose else w)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(
        architectures=[c.architecture], model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, eos_token_id=list(c.eos_token_ids), rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta)))
    tokenizer.hf.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    """A one-layer draft with other attention shapes (2 heads of 32, 1 KV head) that shares
    the target's embedding and most of its head, so it often, not always, predicts the
    target's token: the target's next token is a fixed function of the last one (see
    ``tiny``), and the draft's head has a quarter of its columns swapped among themselves.
    (With the head shared exactly the draft always agreed.)"""
    draft = _tiny_llama(7, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=64)
    draft.embed.set_value(tiny.model.embed[...])
    head = np.array(tiny.model.lm_head[...])                     # [D, V]
    cols = np.random.RandomState(3).choice(V, V // 4, replace=False)
    head[:, cols] = head[:, np.roll(cols, 1)]
    draft.lm_head.set_value(jnp.asarray(head))
    return save_hf_dir(draft, tiny.tokenizer, tmp_path_factory.mktemp("draft"))


def method_options(method: str, draft_dir: str, self_layers: int | None = 1) -> dict:
    if method == "ngram":       # in vLLM's form: every ngram engine test also runs through it
        return dict(speculative_config={"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": K,
                                        "disable_by_batch_size": COMMON["speculative_disable_by_batch_size"]})
    if method == "tree":        # prompt lookup's three likeliest continuations at once
        return dict(speculative_method="ngram", speculative_tree_width=3, ngram_prompt_lookup_min=1, **COMMON)
    if method == "self":    # int8, the tiny target's first layer
        return dict(speculative_method="self", speculative_draft_layers=self_layers, **COMMON)
    return dict(speculative_method="draft", speculative_model=draft_dir, speculative_quantization=None, **COMMON)


@pytest.fixture(scope="module")
def plain(tiny):
    return Engine(loaded=tiny, **KW)


@pytest.fixture(scope="module", params=METHODS)
def spec(request, tiny, draft_dir):
    return Engine(loaded=tiny, **KW, **method_options(request.param, draft_dir))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        motif = rng.randint(3, V, size=3 + i % 5).tolist()
        out.append((motif * 8)[:10 + 7 * i] + rng.randint(3, V, size=i % 3).tolist())
    return out


def _same(a, b, what: str) -> None:
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids, what
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason, what


def _no_leak(eng: Engine) -> None:
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    t = np.array([5, 6, 7, 8, 9, 5, 6, 7], np.int32)
    assert p.propose(t, 2) == [8, 9]                 # 3-gram [5, 6, 7] seen at 0
    assert p.propose(np.array([1, 2, 3], np.int32), 2) == []
    t = np.array([4, 1, 2, 4, 1, 3, 4, 1], np.int32)
    assert p.propose(t, 1) == [3]                    # latest occurrence of [4, 1] with 1 token after
    assert p.propose(t, 4) == [2, 4, 1, 3]           # only the earliest has 4 after it
    # token-tree candidates: propose's first, then other first tokens, latest first
    assert p.candidates(t, 4, 1) == [[2, 4, 1, 3]]
    assert p.candidates(t, 2, 3) == [[3, 4], [2, 4]]    # [4, 1] at 3 (the latest), then at 0
    t = np.array([7, 5, 9, 7, 6, 9, 7, 5, 8, 9, 7], np.int32)
    assert p.candidates(t, 2, 4) == [[5, 8], [6, 9]]      # [9, 7] then [7]: followed by 5 or 6 only
    assert p.candidates(np.array([1, 2, 3], np.int32), 2, 3) == []


def test_scheduler_budgets_drafts_and_trim_frees_pages():
    bm = BlockManager(16, 4)
    s = Scheduler(bm, 4, 6, 64)
    seq = make_sequences("r", [5, 6, 7], SamplingParams(max_tokens=20))[0]
    s.add(seq)
    out = s.schedule()
    s.postprocess(out, {seq.seq_id: 9})               # 4 tokens, 3 computed, 1 page
    out = s.schedule({seq.seq_id: [1, 2, 3, 4, 5, 6, 7]})
    (e,) = out.scheduled
    assert e.draft == (1, 2, 3, 4, 5) and e.num_new_tokens == 6 and e.samples   # cut to the budget of 6
    assert len(seq.page_ids) == 3                     # positions 3..8 -> 9 tokens of KV
    seq.num_computed_tokens = 5                       # as if 1 draft token was accepted
    bm.trim(seq, seq.num_computed_tokens)
    assert len(seq.page_ids) == 2 and bm.num_free_pages == bm.num_usable_pages - 2
    bm.check_invariants()


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_pause_backs_off_while_rounds_fail(method):
    """A sequence whose rounds keep failing proposes again after 8, 16, 32, ... plain steps
    (prompt lookup; a draft model's first pause is 32), one round tried in between, up
    to 128; a round that meets the floor ends the back-off."""
    from jaxinfer.engine.speculative import Speculator

    bm = BlockManager(80, 4)
    sched = Scheduler(bm, 4, 64, 256)
    seq = make_sequences("r", [5, 6, 7] * 3, SamplingParams(max_tokens=200))[0]
    sched.add(seq)
    sched.postprocess(sched.schedule(), {seq.seq_id: 5})
    cfg = EngineConfig(speculative_method="ngram", num_speculative_tokens=7)
    spec = Speculator(cfg, NgramProposer(1, 3) if method == "ngram" else _Always([6, 7, 5, 6, 7, 5, 6]))

    def gaps(accepted: int, rounds: int) -> list[int]:
        """Plain steps before each of ``rounds`` rounds, each yielding ``accepted`` tokens."""
        out, gap = [], 0
        while len(out) < rounds:
            if spec.propose(sched, 8, lambda s: True):
                out.append(gap)
                gap = 0
                spec._pace(seq, accepted)
            else:
                gap += 1
        return out

    first = 8 if method == "ngram" else 32
    # the first rounds get the benefit of the doubt (the average starts at twice the
    # floor and moves a quarter of the way per round), then each failed probe doubles
    assert gaps(0, 8) == [0, 0, 0, first, 2 * first, 4 * first, min(8 * first, 128), 128]
    good = 7 if method == "self" else 1
    gaps(good, 1)                       # a good round ends the back-off
    assert gaps(0, 2) == [0, first]     # EMA above the floor lets one failure pass
    assert spec.min_accepted == (0.5 if method == "ngram" else 3.5)


class _Always:
    """A draft model stand-in that proposes the same tokens for every sequence."""

    def __init__(self, draft: list[int]):
        self.draft = draft

    def propose(self, sched, wanted, ensure):
        return {seq.seq_id: self.draft[:k] for seq, k in wanted}


def test_config_refuses_unsupported():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(speculative_method="ngram", num_scheduler_steps=4)
    with pytest.raises(ValueError, match="ngram_prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", ngram_prompt_lookup_min=5, ngram_prompt_lookup_max=2)
    with pytest.raises(ValueError, match="would draft with the target itself"):
        EngineConfig(speculative_method="self", quantization="int8", speculative_quantization="int8")
    with pytest.raises(ValueError, match="speculative_tree_width.*ngram"):
        EngineConfig(speculative_method="self", speculative_tree_width=2)
    with pytest.raises(ValueError, match="speculative_tree_width"):
        EngineConfig(speculative_method="ngram", speculative_tree_width=5)


def test_vllm_speculative_config():
    """vLLM's ``speculative_config`` (Engine keyword, ``--speculative-config`` JSON) names the
    same settings as the speculative_* fields; unknown keys, trained-head methods, a second
    draft device and a setting given twice are refused by name."""
    from jaxinfer.engine_config import speculative_fields, with_speculative_config
    from jaxinfer.engine_args import engine_config
    from serving.cli import build_parser

    native = EngineConfig(speculative_method="ngram", num_speculative_tokens=5, ngram_prompt_lookup_max=3,
                          ngram_prompt_lookup_min=1, speculative_disable_by_batch_size=4)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 4}
    assert EngineConfig(**with_speculative_config({"speculative_config": spec})) == native
    assert speculative_fields({"model": "/d", "quantization": None}) == dict(
        speculative_method="draft", speculative_model="/d", speculative_quantization=None)
    assert speculative_fields({"method": "self", "quantization": "int8", "draft_layers": 2,
                               "draft_tensor_parallel_size": 1}) == dict(
        speculative_method="self", speculative_quantization="int8", speculative_draft_layers=2)
    for bad, what in (({"method": "eagle", "model": "/e"}, "eagle"), ({"method": "ngram", "k": 3}, "unknown key"),
                      ({"num_speculative_tokens": 3}, "method"), ([1], "expected an object"),
                      ({"method": "draft_model", "model": "/d", "draft_tensor_parallel_size": 2}, "one device")):
        with pytest.raises(ValueError, match=what):
            speculative_fields(bad)
    with pytest.raises(ValueError, match="also given on its own: num_speculative_tokens"):
        with_speculative_config({"speculative_config": spec, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative_config.method"):
        Engine(speculative_config={"method": "medusa"})        # refused before anything loads

    def cli(*flags):
        return engine_config(build_parser().parse_args(["generate", "x", *flags]), default_max_seqs=1)

    cfg = cli("--speculative-config", json.dumps(spec))
    assert [getattr(cfg, f) for f in ("speculative_method", "num_speculative_tokens", "ngram_prompt_lookup_max",
                                      "ngram_prompt_lookup_min", "speculative_disable_by_batch_size")] == \
        ["ngram", 5, 3, 1, 4]
    assert cli("--speculative-config", json.dumps({**spec, "tree_width": 2})).speculative_tree_width == 2
    assert cli("--speculative-method", "ngram", "--speculative-tree-width", "3").speculative_tree_width == 3
    with pytest.raises(ValueError, match="not valid JSON"):
        cli("--speculative-config", "{method: ngram}")
    with pytest.raises(ValueError, match="give one of them"):
        cli("--speculative-config", json.dumps(spec), "--speculative-method", "ngram")


def test_auto_draft_quantization():
    """speculative_quantization "auto" (the default): int4 where the CPU kernel's 4-bit panels
    run or the target is quantized, int8 otherwise; an explicit choice is kept."""
    from jaxinfer.engine_config import draft_quantization

    c = EngineConfig(speculative_method="self")
    assert c.speculative_quantization == "auto"
    assert (draft_quantization(c, True), draft_quantization(c, False)) == ("int4", "int8")
    q8 = EngineConfig(speculative_method="self", quantization="int8")      # valid: its draft is int4
    assert draft_quantization(q8, False) == "int4"
    assert draft_quantization(EngineConfig(speculative_method="self", speculative_quantization="int8"), True) == "int8"
    assert draft_quantization(EngineConfig(speculative_method="self", speculative_quantization=None,
                                           speculative_draft_layers=1), True) is None


def test_greedy_identical_alone_and_batched(plain, spec):
    prompts = _prompts(4)
    ps = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, ps)
    s0 = spec.stats()
    for p, w in zip(prompts, want):                   # alone
        _same([w], spec.generate([p], ps), "alone")
    got = spec.generate(prompts, ps)                  # batched
    _same(want, got, "batched")
    for x, y in zip(want, got):
        assert y.outputs[0].logprobs == x.outputs[0].logprobs      # bitwise, top-2 included
    st = spec.stats()
    accepted = st["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"]
    drafted = st["spec_decode_num_draft_tokens"] - s0["spec_decode_num_draft_tokens"]
    # the drafts really were verified, runs longer than one token accepted, and some
    # drafts rejected (their pages rolled back). 'self' drafts with the target's own first
    # layer, which on this tiny random model predicts as the whole model (see draft_dir):
    # its rejections are exercised by test_sampling_distribution_is_the_targets.
    assert accepted > 40 and st["spec_decode_num_accepted_tokens_per_pos"][1] > 0
    if spec.config.speculative_method != "self":
        assert drafted > accepted, (drafted, accepted)
    _no_leak(spec)


def _greedy_as_plain_alone_and_batched(eng: Engine, plain: Engine, seed: int) -> dict:
    """4 prompts x 40 greedy tokens: ``eng`` gives ``plain``'s tokens alone and with
    requests arriving mid-run, compiles nothing, leaks no page; returns ``eng.stats()``."""
    prompts = _prompts(4)
    ps = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate(prompts, ps)
    _same(want[:1], eng.generate(prompts[:1], ps), "alone")
    outs, compiles = run_with_arrivals(eng, prompts, [ps] * len(prompts), np.random.RandomState(seed), "r", 2)
    assert compiles == 0
    _same(want, [outs[f"r{i}"] for i in range(len(prompts))], "batched")
    _no_leak(eng)
    return eng.stats()


def test_self_int4_draft_on_the_cpu_kernel(tiny, plain):
    """'self' with speculative_quantization='int4' on CPU: every layer's weights become the
    C++ kernel's 4-bit panels (float16 scales and offsets), the LM head int8; greedy
    output is the plain engine's, alone and batched, with drafts accepted; nothing
    compiles after warm-up; no page leaks."""
    from pallas_kernels.quantized_matmul import cpu as cpu_matmul

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the CPU int8/int4 kernel cannot be built here")
    assert cpu_matmul.available(), cpu_matmul.unavailable_reason()
    eng = Engine(loaded=tiny, **KW, speculative_method="self", speculative_quantization="int4", **COMMON)
    draft = eng.speculator.proposer.runner
    kinds = {(leaf.dtype.name, leaf.ndim) for leaf in draft.state_leaves}
    assert ("float16", 3) in kinds or ("float16", 4) in kinds, kinds       # the panels' scales
    st = _greedy_as_plain_alone_and_batched(eng, plain, seed=1)
    assert st["spec_decode_num_accepted_tokens"] > 40, st


def test_self_on_an_int8_target_reads_its_int8_pages(tiny):
    """An int8 target with int8 KV pages (asked for: a speculating engine keeps float pages
    by default, config.kv_cache_dtype) and 'self' drafting (int4 by default) on those very
    pages: greedy output is the plain int8 engine's, batched and alone, with drafts
    accepted; nothing compiles after warm-up; no leak."""
    plain8 = Engine(loaded=tiny, **KW, quantization="int8")
    eng = Engine(loaded=tiny, **KW, quantization="int8", kv_cache_dtype="int8", speculative_method="self",
                 **COMMON)
    assert plain8.stats()["kv_cache_dtype"] == eng.stats()["kv_cache_dtype"] == "int8"
    st = _greedy_as_plain_alone_and_batched(eng, plain8, seed=2)
    assert st["spec_decode_num_accepted_tokens"] > 0, st


def test_self_draft_reads_the_targets_kv_pool(plain, tiny, draft_dir, monkeypatch):
    """'self' keeps no KV pool of its own: its multi-step decode runs on the target's pages
    (spec_draft.own_pool: it never allocates one), so it never catches up on a prompt and compiles no
    single-step forward; the target's tokens and logprobs stay the plain engine's bits
    (the target writes every position it verifies before reading it). 'draft' (another
    model) keeps its own pool and catches up. On an accelerator the target's pool takes most
    of the free memory, so 'self' must never allocate one, not even for a moment (an H200
    ran out of memory when the draft's pool came first, 2026-11-28)."""
    from jaxinfer.engine import kv_cache as kvc

    pools = []                          # the layer counts of every pool allocated
    allocate = kvc.allocate_kv_cache
    monkeypatch.setattr(kvc, "allocate_kv_cache", lambda spec, *a, **k: pools.append(spec.num_layers) or allocate(spec, *a, **k))
    prompts = _prompts(4, seed=5)
    ps = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, ps)
    for method in ("self", "draft"):
        pools.clear()
        eng = Engine(loaded=tiny, **KW, **method_options(method, draft_dir))
        d = eng.speculator.proposer
        assert pools == ([tiny.model.cfg.num_layers] if method == "self" else [tiny.model.cfg.num_layers, 1]), pools
        got = eng.generate(prompts, ps)
        _same(want, got, method)
        assert [g.outputs[0].logprobs for g in got] == [w.outputs[0].logprobs for w in want]
        assert eng.stats()["spec_decode_num_accepted_tokens"] > 0
        if method == "self":
            assert d.target is eng.replicas[0].runner and d.runner.kv is None
            assert d.num_catch_up_tokens == 0 and not d.runner.executables and d.runner.multi_executables
            assert all(b.num_prefill == 0 for b in d.buckets)
        else:
            assert d.target is None and d.runner.kv is not None and d.num_catch_up_tokens > 0
        _no_leak(eng)


def test_a_draft_with_its_own_pool_shares_the_kv_budget(tiny):
    """A draft with a pool of its own has the target's page count: the KV budget (here
    kv_cache_memory; on an accelerator a fraction of the free memory) pays for each page
    in both pools, not the target's alone (the engine's call: resources.kv_cache_spec with
    ``also``; a 'self' draft that steps on the target's pages passes none)."""
    from jaxinfer.engine import resources as R
    from jaxinfer.engine.spec_draft import draft_kv_spec

    budget = 200_000
    kw = {k: v for k, v in KW.items() if k != "progress"}
    config = EngineConfig(**{**kw, "num_pages": None, "kv_cache_memory": budget})
    draft = _tiny_llama(7, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=64)
    mc = tiny.model.cfg
    args = (config, mc, mc.num_kv_heads, tiny.model.dtype, 128)
    both = R.kv_cache_spec(*args, also=lambda spec: draft_kv_spec(draft, spec))
    alone = R.kv_cache_spec(*args)
    pages = draft_kv_spec(draft, both)
    assert both.num_pages == budget // (both.bytes_per_page + pages.bytes_per_page) < alone.num_pages
    assert alone.num_pages == budget // alone.bytes_per_page and pages.num_pages == both.num_pages


def test_stop_and_max_tokens_inside_a_run(plain, spec):
    prompts = _prompts(3, seed=1)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = []
    for r in ref:
        toks = r.outputs[0].token_ids
        # a stop token first seen at output index >= 4, and a max_tokens off the run grid
        i = next((i for i in range(4, len(toks)) if toks[i] not in toks[:i]), None)
        params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                     stop_token_ids=[toks[i]]) if i else None)
        params.append(SamplingParams(temperature=0, max_tokens=7 + len(params), ignore_eos=True))
    cases = [(p, sp) for p, pair in zip(prompts, zip(params[::2], params[1::2])) for sp in pair if sp]
    for p, r in zip(prompts, ref):                    # a stop string from the middle of the text
        text = r.outputs[0].text
        if len(text) >= 12:
            cases.append((p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                            stop=[text[len(text) // 2:len(text) // 2 + 3]])))
    assert len(cases) >= 6
    want = plain.generate([p for p, _ in cases], [sp for _, sp in cases])
    got = spec.generate([p for p, _ in cases], [sp for _, sp in cases])
    _same(want, got, "stop / max_tokens")
    reasons = [o.outputs[0].stop_reason for o in got]
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    _no_leak(spec)


def test_seeded_sampling_identical_and_continuous_batching_compiles_nothing(plain, spec):
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True)
              if i % 2 else SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = plain.generate(prompts, params)
    outs, compiles = run_with_arrivals(spec, prompts, params, np.random.RandomState(0), "cb", 2)
    assert compiles == 0
    _same(want, [outs[f"cb{i}"] for i in range(len(prompts))], "continuous batching")
    _no_leak(spec)


def test_penalties_speculate_with_the_plain_tokens(plain, spec):
    """Repetition / presence / frequency penalties under speculation: draft tokens are
    counted only once accepted, and verification slot j counts the j drafts before it, so
    the tokens and logprobs are the plain engine's, alone and with requests arriving
    mid-run (a seeded sampled one too); the penalized requests' drafts are verified and
    accepted; nothing compiles after warm-up, no page leaks. The prompts lead into the tiny
    model's one 2-cycle (5, 33, 5, ...), which a frequency penalty breaks after a number
    of repeats that depends on every counted token: a draft token counted too early, too
    late or twice moves the break."""
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, V, size=4 + 3 * i).tolist() + [5, 33, 5] for i in range(5)]
    kw = dict(max_tokens=32, ignore_eos=True, logprobs=2)
    params = [SamplingParams(temperature=0, frequency_penalty=0.45, **kw),
              SamplingParams(temperature=0, frequency_penalty=0.55, presence_penalty=0.5, **kw),
              SamplingParams(temperature=0, frequency_penalty=0.65, **kw),
              SamplingParams(temperature=0, frequency_penalty=0.8, repetition_penalty=1.2, **kw),
              SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.4, **kw)]
    want = plain.generate(prompts, params)
    free = plain.generate(prompts, SamplingParams(temperature=0, **kw))
    # the penalties change what these prompts give (else this would test nothing)
    assert all(w.outputs[0].token_ids != f.outputs[0].token_ids for w, f in zip(want, free))
    s0 = spec.stats()
    for p, sp, w in zip(prompts, params, want):                  # alone
        got = spec.generate([p], sp)
        _same([w], got, f"alone {sp}")
        assert got[0].outputs[0].logprobs == w.outputs[0].logprobs
    st = spec.stats()
    assert st["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"] > 20
    outs, compiles = run_with_arrivals(spec, prompts, params, np.random.RandomState(5), "pen", 2)
    assert compiles == 0
    _same(want, [outs[f"pen{i}"] for i in range(len(prompts))], "batched")
    for i, w in enumerate(want):
        assert outs[f"pen{i}"].outputs[0].logprobs == w.outputs[0].logprobs
    _no_leak(spec)


@pytest.mark.parametrize("method", METHODS)
def test_preemption(tiny, plain, draft_dir, method):
    eng = Engine(loaded=tiny, **{**KW, "num_pages": 17}, **method_options(method, draft_dir))
    prompts = _prompts(4, seed=3)
    ps = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # half with a frequency penalty: a recompute rebuilds its counts (accepted drafts included)
    ps = [ps, dataclasses.replace(ps, frequency_penalty=0.5)] * 2
    want = plain.generate(prompts, ps)
    _same(want, eng.generate(prompts, ps), "preemption")
    assert eng.stats()["num_preemptions_total"] > 0 and eng.stats()["spec_decode_num_accepted_tokens"] > 0
    _no_leak(eng)


def test_tree_branch_wins_with_the_plain_tokens(tiny, plain):
    """Prompts whose latest n-gram match proposes a wrong continuation and an older one the
    right one: the tree verifies both, the older one's branch wins (its pages become the
    sequence's), and every token is the plain path's, alone and beside other requests; no
    compile after warm-up, no page leaked (branches and their copied pages included)."""
    eng = Engine(loaded=tiny, **KW, **method_options("tree", ""))
    ps = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = []
    for i, c0 in enumerate((3, 9, 20, 41)):
        # c: the tiny model's greedy continuation of c0 (it follows it in context too). The
        # prompt ends in c0, the step after the prefill feeds c1: then [c0, c1] was last
        # followed by the detour y (the first chain, wrong) and before that by c2 (a branch's)
        c = [c0] + plain.generate([[c0]], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
                                  )[0].outputs[0].token_ids
        y = [t for t in np.random.RandomState(i).randint(3, V, size=40).tolist() if t not in c][:6]
        prompts.append(c[:8] + [y[0], c0, c[1]] + y[1:5] + [y[5], c0])
    want = plain.generate(prompts, ps)
    tree = eng.speculator.tree
    for p, w in zip(prompts, want):
        _same([w], eng.generate([p], ps), "alone")
    assert tree.num_wins >= len(prompts), (tree.num_branches, tree.num_wins)
    wins = tree.num_wins
    outs, compiles = run_with_arrivals(eng, prompts + _prompts(3), [ps] * 7, np.random.RandomState(1), "t", 2)
    assert compiles == 0
    _same(want + plain.generate(_prompts(3), ps), [outs[f"t{i}"] for i in range(7)], "batched")
    for i, w in enumerate(want):
        assert outs[f"t{i}"].outputs[0].logprobs == w.outputs[0].logprobs
    assert tree.num_wins > wins and not tree.parent_of
    assert eng.scheduler.num_running == 0
    _no_leak(eng)


def _first_tokens(eng: Engine, seeds: range, prompt: list[int]) -> Counter:
    """Counts of the first three output tokens (as a triple), one request per seed."""
    params = [SamplingParams(temperature=8.0, top_k=2, seed=s, max_tokens=4, ignore_eos=True) for s in seeds]
    # one at a time: a step carrying another request's prefill does not speculate
    return Counter(tuple(eng.generate([prompt], sp)[0].outputs[0].token_ids[:3]) for sp in params)


def test_sampling_distribution_is_the_targets(plain, spec):
    """Fresh seeds on both sides (same seeds would give identical tokens): a two-sample
    chi-square on the joint of the first three output tokens (the second and third are
    decided by verifying drafts). top_k=2 at a high temperature gives two likely tokens
    of similar probability, so drafts are often rejected. Checked by breaking the rule
    locally: accepting 30% of the mismatched drafts fails with p = 1.3e-4 (and the
    seeded-identity test above catches any change of the rule token for token)."""
    from scipy.stats import chi2_contingency

    # the model's own greedy continuation: the drafts are likely tokens, so both acceptance
    # and rejection happen often
    seed_prompt = _prompts(1, seed=4)[0]
    prompt = seed_prompt + plain.generate([seed_prompt], SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True))[0].outputs[0].token_ids
    n = 500
    s0 = spec.stats()["spec_decode_num_draft_tokens"]
    got = _first_tokens(spec, range(n), prompt)
    want = _first_tokens(plain, range(n, 2 * n), prompt)
    assert spec.stats()["spec_decode_num_draft_tokens"] - s0 >= n      # drafts were verified
    cells = sorted(set(got) | set(want))
    table = np.array([[c[k] for k in cells] for c in (got, want)])
    rare = table.sum(0) < 10                  # pool rare triples into one cell
    table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, f"p = {p:.2g}, table {table.tolist()}"


def test_metrics_export_spec_counters(spec):
    from serving.metrics import _EngineCollector

    fams = {f.name: f for f in _EngineCollector(lambda: spec, lambda: "m").collect()}
    st = spec.stats()
    assert fams["jaxinfer:spec_decode_num_accepted_tokens"].samples[0].value == st["spec_decode_num_accepted_tokens"]
    per_pos = fams["jaxinfer:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.value for s in per_pos] == st["spec_decode_num_accepted_tokens_per_pos"] and len(per_pos) == K
    tree = "jaxinfer:spec_decode_num_tree_branches" in fams
    assert tree == (spec.config.speculative_tree_width > 1)
    if tree:
        assert fams["jaxinfer:spec_decode_num_tree_branches"].samples[0].value == spec.speculator.tree.num_branches


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def _reference_tokens(ref, prompt: list[int], ps: SamplingParams) -> list[int]:
    """The reference generator's greedy tokens for ``prompt`` alone, once per prompt for
    both methods. Padded to 128 positions in a 512-position cache: test_engine's reference
    shapes (the run's compilation cache serves both; the tokens do not depend on padding)."""
    key = tuple(prompt)
    if key not in _REFERENCE:
        assert len(prompt) + ps.max_tokens <= 128
        _REFERENCE[key] = ref.generate([prompt], [ps], [0], pad_to=128, cache_len=512)[0].token_ids
    return _REFERENCE[key]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_default_model_greedy_matches_reference(method):
    """The real default model: text that the answer copies (so prompt lookup proposes and
    much is accepted; the int8 self-draft agrees with the float model on most tokens
    anyway), alone and three at a time, token-exact against the reference generator; no
    page leaked."""
    from jaxinfer.loading import load_model
    from jaxinfer.reference import ReferenceGenerator
    from test_engine import DEFAULT_MODEL_ENGINE_KW

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    # lazy warm-up: only the step shapes used are compiled (the tiny-model tests assert
    # that nothing compiles after a full warm-up)
    eng = Engine(loaded=loaded, progress=False, warmup="lazy", **DEFAULT_MODEL_ENGINE_KW,
                 **method_options(method, "", None))
    texts = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
             "List the names in: Alice Moreau lives in Lyon, Jean Moreau in Paris, Tom Becker in Hamburg.",
             "def add(a, b):\n    return a + b\n\nRewrite this function with type hints."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    ps = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [eng.generate([p], ps)[0] for p in prompts[:1]] + eng.generate(prompts, ps)
    ref = ReferenceGenerator(eng.loaded.model)   # the engine's weights, test_engine's reference
    for p, g in zip(prompts[:1] + prompts, got):
        assert g.outputs[0].token_ids == _reference_tokens(ref, p, ps)
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] >= (10 if method == "ngram" else 40), st
    _no_leak(eng)


def test_streaming_through_async_engine(plain, spec):
    """AsyncEngine (the server's path): accepted runs arrive as growing outputs whose
    final tokens are the plain engine's."""
    from test_engine import stream_through_async_engine

    prompts = _prompts(2, seed=5)
    ps = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = plain.generate(prompts, ps)
    a0 = spec.stats()["spec_decode_num_accepted_tokens"]
    for (final, seen), w in zip(stream_through_async_engine(spec, prompts, ps), want):
        assert final.finished and final.outputs[0].token_ids == w.outputs[0].token_ids
        assert all(seen[i + 1][:len(seen[i])] == seen[i] for i in range(len(seen) - 1))
    assert spec.stats()["spec_decode_num_accepted_tokens"] > a0
    _no_leak(spec)

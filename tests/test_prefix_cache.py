"""Prefix caching (on by default), its host-memory tier and cache_salt.

Host-only tests of the block manager's tier bookkeeping run in milliseconds. The engine
tests compare greedy tokens with the cache off, on, and on with the host tier, under
churn (more distinct prefixes than the device holds), with every freed or evicted page
poisoned (NaN) before the next step: a read of a freed page would change the tokens.
The acceptance test on the real default model replays multi-turn MT-Bench conversations.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import jax
import numpy as np
import pytest
from flax import nnx

from jaxinfer.engine_config import EngineConfig
from jaxinfer.models.config import ModelConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.block_manager import BlockManager, PageOp
from jaxinfer.engine.host_page_index import HostPage
from jaxinfer.engine.sequence import Sequence, next_seq_id
from prompt_data import data_dir

PS = 4


def mkseq(prompt, salt: str | None = None) -> Sequence:
    return Sequence(seq_id=next_seq_id(), request_id=f"r{next_seq_id()}", prompt_token_ids=list(prompt),
                    params=SamplingParams(cache_salt=salt))


def run_prefill(bm: BlockManager, seq: Sequence) -> list:
    """Admit ``seq`` the way the scheduler does (hit, then allocate) and mark it computed."""
    hit = bm.lookup_prefix(seq)
    assert bm.allocate_for(seq, seq.num_tokens, prefix_pages=hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed(seq)
    return hit


def check(bm: BlockManager, live: list[Sequence]) -> None:
    bm.check_invariants()
    held = Counter(p for s in live for p in s.page_ids)
    assert all(bm.refcount(p) == held.get(p, 0) for p in range(bm.num_pages))


# ---- host only ----------------------------------------------------------------------

def test_evicted_pages_go_to_the_host_and_come_back():
    bm = BlockManager(num_pages=5, page_size=PS, enable_prefix_caching=True, num_host_pages=8)
    a = mkseq(range(100, 109))                         # 2 full pages + 1
    run_prefill(bm, a)
    a_pages = list(a.page_ids)
    bm.free(a)
    assert bm.take_page_ops() == []                    # still on the device: nothing moves
    b = mkseq(range(200, 216))                         # 4 pages: the 2 cached ones are evicted
    run_prefill(bm, b)
    ops = bm.take_page_ops()
    # Leaves first: a's second page (the leaf) is evicted before its first.
    assert [(o.kind, o.page) for o in ops] == [("to_host", a_pages[1]), ("to_host", a_pages[0])]
    assert bm.num_cached_pages == 4 and bm.num_host_cached_pages == 2
    bm.free(b)
    c = mkseq(range(100, 109))
    hit = bm.lookup_prefix(c)
    assert hit == [HostPage(ops[1].slot), HostPage(ops[0].slot)]
    assert bm.allocate_for(c, 9, prefix_pages=hit)
    moves = [o for o in bm.take_page_ops() if o.kind == "to_device"]
    assert [(o.page, o.slot) for o in moves] == [(c.page_ids[0], hit[0].slot), (c.page_ids[1], hit[1].slot)]
    # Inclusive tier: the pages stay on the host, and are found on the device now.
    assert bm.num_host_cached_pages >= 2
    assert bm.lookup_prefix(mkseq(range(100, 109))) == c.page_ids[:2]
    check(bm, [c])
    bm.free(c)
    check(bm, [])


def test_ops_keep_their_order_when_a_slot_or_page_is_reused():
    """A tiny host pool: evictions overwrite slots that earlier ops read. Replaying the ops
    in order on a model of the two memories must give every live page its own tokens."""
    rng = random.Random(7)
    bm = BlockManager(num_pages=7, page_size=PS, enable_prefix_caching=True, num_host_pages=3,
                      record_freed=True)
    device: dict[int, tuple | None] = {}
    host: dict[int, tuple | None] = {}
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(5, 14))] for _ in range(6)]
    live: list[Sequence] = []
    for step in range(800):
        if live and (rng.random() < 0.45 or len(live) > 2):
            bm.free(live.pop(rng.randrange(len(live))))
        s = mkseq(rng.choice(prompts))
        hit = bm.lookup_prefix(s)
        if not bm.allocate_for(s, s.num_tokens, prefix_pages=hit):
            continue
        for op in bm.take_page_ops():
            if op.kind == "to_host":
                host[op.slot] = device[op.page]
            elif op.kind == "to_device":
                device[op.page] = host[op.slot]
            else:
                device[op.page] = None                 # poisoned
        for i, p in enumerate(s.page_ids[:len(hit)]):  # every hit page holds its tokens
            assert device[p] == tuple(s.prompt_token_ids[i * PS:(i + 1) * PS]), f"step {step}"
        for i, p in enumerate(s.page_ids):             # the step computes the rest
            device[p] = tuple(s.prompt_token_ids[i * PS:(i + 1) * PS])
        s.num_computed_tokens = s.num_tokens
        bm.cache_computed(s)
        live.append(s)
        check(bm, live)
    for s in live:
        bm.free(s)
    check(bm, [])
    assert bm.num_free_pages == bm.num_usable_pages


def test_cache_salt_separates_tenants():
    bm = BlockManager(num_pages=16, page_size=PS, enable_prefix_caching=True)
    run_prefill(bm, mkseq(range(9), salt="tenant-a"))
    assert len(bm.lookup_prefix(mkseq(range(9), salt="tenant-a"))) == 2
    assert bm.lookup_prefix(mkseq(range(9), salt="tenant-b")) == []
    assert bm.lookup_prefix(mkseq(range(9))) == []
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 5000)


def test_scheduler_counts_queries_and_hits():
    from jaxinfer.engine.scheduler import Scheduler

    bm = BlockManager(num_pages=32, page_size=PS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    for rid in ("a", "b"):
        sched.add(Sequence(next_seq_id(), rid, list(range(10)), SamplingParams(max_tokens=1)))
        out = sched.schedule()
        assert out.scheduled[-1].start_pos == (0 if rid == "a" else 8)   # b starts past the hit
        sched.postprocess(out, {e.seq.seq_id: 1 for e in out.scheduled})
        for e in out.scheduled:
            sched.finish(e.seq, "length")
    st = sched.prefix_cache_stats()
    assert st["prefix_cache_queries_total"] == 20 and st["prefix_cache_hits_total"] == 8
    assert st["prefix_cache_pages"] == 2 and bm.num_free_pages == 31


def test_data_parallel_admission_prefers_the_longest_cached_prefix():
    from types import SimpleNamespace

    from jaxinfer.engine.engine import Engine

    bms = [BlockManager(num_pages=16, page_size=PS, enable_prefix_caching=True) for _ in range(3)]
    run_prefill(bms[1], mkseq(range(5)))                # 1 page of the prompt below
    run_prefill(bms[2], mkseq(range(13)))               # 3 pages
    fake = SimpleNamespace(replicas=[SimpleNamespace(block_manager=bm, load=load)
                                     for bm, load in zip(bms, (0, 5, 9))])
    assert Engine._pick_replica(fake, mkseq(range(20))) == 2          # longest prefix, though busiest
    assert Engine._pick_replica(fake, mkseq([7] * 20)) == 0           # no hit anywhere: least loaded
    assert Engine._pick_replica(fake, mkseq(range(20), salt="x")) == 0


def test_engine_config_defaults_and_cli_flag():
    from jaxinfer.engine_args import engine_config
    from serving.cli import build_parser

    assert EngineConfig().enable_prefix_caching
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_config(args, 1).enable_prefix_caching
    args = build_parser().parse_args(["generate", "hi", "--no-enable-prefix-caching",
                                      "--host-kv-cache-memory", "1000000"])
    cfg = engine_config(args, 1)
    assert not cfg.enable_prefix_caching and cfg.host_kv_cache_memory == 1000000
    with pytest.raises(ValueError, match="host_kv_cache_memory"):
        EngineConfig(host_kv_cache_memory=-1)


def test_server_reads_cache_salt_and_exports_cache_metrics():
    from serving.metrics import ServingMetrics
    from serving.errors import ProtocolError
    from serving.openai_request import parse_completion_request
    from serving.fields import Limits

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) % 200 for c in text]

    limits = Limits(model_names=("m",), max_model_len=64, max_n=4, vocab_size=256)
    req = parse_completion_request({"prompt": "hello", "cache_salt": "team-7", "max_tokens": 2}, limits, Tok())
    assert req.params.cache_salt == "team-7"
    assert parse_completion_request({"prompt": "hello"}, limits, Tok()).params.cache_salt is None
    for salt in ("", 5, "x" * 2000):
        with pytest.raises(ProtocolError) as e:
            parse_completion_request({"prompt": "hello", "cache_salt": salt}, limits, Tok())
        assert e.value.status == 400 and e.value.param == "cache_salt"

    class Eng:
        def stats(self):
            return {"prefix_cache_queries_total": 100, "prefix_cache_hits_total": 64,
                    "prefix_cache_host_hits_total": 16, "prefix_cache_pages": 5, "host_cache_pages": 2,
                    "host_cache_total_pages": 8}

    text = ServingMetrics(lambda: Eng(), lambda: "m").render().decode()
    for line in ('jaxinfer:prefix_cache_queries_total{model_name="m"} 100.0',
                 'jaxinfer:prefix_cache_hits_total{model_name="m"} 64.0',
                 'jaxinfer:external_prefix_cache_hits_total{model_name="m"} 16.0',
                 'jaxinfer:prefix_cache_pages{model_name="m"} 5.0',
                 'jaxinfer:host_prefix_cache_pages{model_name="m"} 2.0'):
        assert line in text, line


# ---- the engine on a tiny model -------------------------------------------------------

class _Tok:
    eos_token_ids = (2,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def _tiny_loaded():
    from jaxinfer.loading import LoadedModel
    from jaxinfer.models.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_ids=(2,))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    emb = model.embed[...]                  # spread the logits: greedy is then no coin toss
    model.embed.set_value(emb * 40.0)
    model.lm_head.set_value(emb.T * 40.0)
    return LoadedModel(cfg, model, _Tok(), {}, "tiny-random-llama")


# 23 usable pages of 16 tokens: the churn below needs ~40 distinct prefix pages.
TINY_KW = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=24, page_size=16,
               min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((4, 16),),
               page_buckets=(16,))


@pytest.fixture(scope="module")
def engines():
    from jaxinfer.engine.engine import Engine

    loaded = _tiny_loaded()
    off = Engine(loaded=loaded, progress=False, enable_prefix_caching=False, **TINY_KW)
    page = off.kv_spec.bytes_per_page
    on = Engine(loaded=loaded, progress=False, debug_poison_freed_pages=True, host_kv_cache_memory=0, **TINY_KW)
    host = Engine(loaded=loaded, progress=False, debug_poison_freed_pages=True,
                  host_kv_cache_memory=48 * page, **TINY_KW)
    return {"off": off, "on": on, "host": host}


def churn_prompts(seed: int = 0) -> list[list[int]]:
    """Rounds over 10 distinct 4-page prefixes (40 pages > the device's 23), each with a
    new tail: later rounds hit prefixes that were evicted meanwhile."""
    rng = np.random.RandomState(seed)
    prefixes = [rng.randint(3, 512, size=64).tolist() for _ in range(10)]
    return [p + rng.randint(3, 512, size=int(rng.randint(1, 24))).tolist()
            for _ in range(3) for p in prefixes]


class _count_compiles:
    """Counts XLA backend compiles (jax.monitoring events) inside the ``with``."""

    active: "_count_compiles | None" = None
    registered = False

    def __enter__(self):
        if not _count_compiles.registered:
            jax.monitoring.register_event_duration_secs_listener(_count_compiles._on_event)
            _count_compiles.registered = True
        self.count = 0
        _count_compiles.active = self
        return self

    def __exit__(self, *exc):
        _count_compiles.active = None

    @staticmethod
    def _on_event(name, secs, **kw):
        if _count_compiles.active is not None and name == "/jax/core/compile/backend_compile_duration":
            _count_compiles.active.count += 1


def run_rounds(eng, prompts, params, abort_every: int = 0):
    """Three requests at a time (the rest wait); with ``abort_every``, every k-th request
    is aborted after its first step (a prefill that had pages, then lost them)."""
    outs = {}
    with _count_compiles() as compiles:
        for i in range(0, len(prompts), 3):
            ids = [eng.add_request(p, params, request_id=f"q{i + j}") for j, p in enumerate(prompts[i:i + 3])]
            if abort_every:
                eng.step()
                for j, rid in enumerate(ids):
                    if (i + j) % abort_every == abort_every - 1:
                        eng.abort(rid)
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        outs[o.request_id] = o.outputs[0].token_ids
    return outs, compiles.count


def assert_clean(eng) -> None:
    """No page leaked: every page free or evictable, every refcount back to zero."""
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"], "leaked KV pages"
    bm = eng.block_manager
    bm.check_invariants()
    assert all(bm.refcount(p) == 0 for p in range(bm.num_pages))


def test_churn_token_exact_with_poisoned_freed_pages(engines):
    prompts = churn_prompts()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, _ = run_rounds(engines["off"], prompts, sp)
    for name in ("on", "host"):
        eng = engines[name]
        # the layers loop: the page moves below run on the stacked pool (kv_cache.StackedKV)
        assert type(eng.runner.kv).__name__ == "StackedKV"
        before = eng.stats()
        got, compiles = run_rounds(eng, prompts, sp)
        assert got == want, f"cache {name}: tokens differ from the cache-off engine"
        assert compiles == 0, f"cache {name}: {compiles} compiles after warm-up"
        st = eng.stats()
        hits = st["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
        host_hits = st["prefix_cache_host_hits_total"] - before["prefix_cache_host_hits_total"]
        assert st["prefix_cache_queries_total"] > before["prefix_cache_queries_total"]
        if name == "host":       # the device holds 23 pages of the 40, the host all 40
            assert hits == 2 * 10 * 64 and host_hits >= 10 * 64, st
            assert eng.runner.page_mover.pages_to_device > 0
        else:
            assert host_hits == 0 and st["host_cache_pages"] == 0
        assert_clean(eng)


def test_shared_prefix_n_samples_preemption_and_abort(engines):
    """A shared system prompt, n = 3 samples, and aborts mid-prefill, with a cache too small
    for all of it (preemption): same tokens as the cache off; nothing leaks."""
    rng = np.random.RandomState(3)
    system = rng.randint(3, 512, size=70).tolist()
    prompts = [system + rng.randint(3, 512, size=int(rng.randint(2, 40))).tolist() for _ in range(9)]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, n=3)
    want, _ = run_rounds(engines["off"], prompts, sp, abort_every=4)
    for name in ("on", "host"):
        eng = engines[name]
        pre = eng.stats()["num_preemptions_total"]
        got, _ = run_rounds(eng, prompts, sp, abort_every=4)
        assert got == want, name
        assert eng.stats()["num_preemptions_total"] > pre, "the test meant to force preemption"
        assert_clean(eng)


def test_prompts_differing_only_in_their_last_page(engines):
    rng = np.random.RandomState(5)
    base = rng.randint(3, 512, size=80).tolist()           # 5 full pages
    prompts = [base[:-3] + rng.randint(3, 512, size=3).tolist() for _ in range(6)]
    prompts += [base[:64], base[:65], base]                 # exactly 4 pages: the last token is recomputed
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engines["off"].generate(prompts, sp)]
    eng = engines["on"]
    eng.generate([base], sp)                               # cache the whole base prompt first
    hits0 = eng.stats()["prefix_cache_hits_total"]
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, sp)]
    assert got == want
    assert eng.stats()["prefix_cache_hits_total"] - hits0 >= 6 * 64
    assert_clean(eng)


def test_poisoning_a_cached_page_changes_the_output(engines):
    """The churn test's poison is real: poisoning a page the cache still holds (a bug the
    block manager must never make) does change the tokens of a request that hits it."""
    eng = engines["on"]
    rng = np.random.RandomState(11)
    prompt = rng.randint(3, 512, size=50).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = eng.generate([prompt], sp)[0].outputs[0].token_ids
    seq = mkseq(prompt)
    hit = eng.block_manager.lookup_prefix(seq)
    assert len(hit) == 3
    eng.runner.apply_page_ops([PageOp("poison", hit[1])], poison=True)
    got = eng.generate([prompt], sp)[0].outputs[0].token_ids
    assert got != want
    eng.reset_prefix_cache()                                # forget the poisoned page
    assert eng.generate([prompt], sp)[0].outputs[0].token_ids == want
    assert_clean(eng)


def test_cache_salt_in_the_engine(engines):
    eng = engines["on"]
    prompt = list(range(10, 60))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.generate([prompt], sp.replace(cache_salt="alice"))
    h0 = eng.stats()["prefix_cache_hits_total"]
    a = eng.generate([prompt], sp.replace(cache_salt="bob"))[0]
    assert eng.stats()["prefix_cache_hits_total"] == h0           # another tenant: no hit
    b = eng.generate([prompt], sp.replace(cache_salt="alice"))[0]
    assert eng.stats()["prefix_cache_hits_total"] == h0 + 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_clean(eng)


# ---- the default model, multi-turn --------------------------------------------------------

FALLBACK_CONVERSATIONS = [
    ["Write a short travel note about a rainy day in Lisbon.", "Now rewrite it as a haiku."],
    ["Explain what a hash table is to a new programmer.", "Give a Python example of one."],
    ["List three causes of the French Revolution.", "Which of them mattered most, and why?"],
]
SYSTEM = ("You are a careful assistant for a software company. Answer briefly, cite the "
          "relevant policy section when you can, and never invent product names. ")


def conversations(n: int) -> list[list[str]]:
    """MT-Bench's two-turn questions where ../shared/data has them, else our own."""
    path = data_dir() / "mt_bench_questions.jsonl"
    if path.exists():
        return [json.loads(line)["turns"][:2] for line in path.read_text().splitlines()[:n]]
    return FALLBACK_CONVERSATIONS[:n]


# The shapes of tests/test_engine.py's default-model engine: the run's compilation cache
# then serves both.
DEFAULT_MODEL_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, num_pages=48,
                        page_buckets=(32,), min_sampler_rows=16, decode_buckets=(1, 8), mixed_decode_buckets=(0, 8),
                        prefill_buckets=((4, 16),))


@pytest.mark.slow
def test_default_model_multi_turn_token_exact():
    """Turn 2 = turn 1 + the reply + a new user turn; a shared system prompt; prompts that
    differ in their last page: greedy tokens equal with the cache off and on (host tier on,
    freed pages poisoned), and turn 2 reuses turn 1's pages."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    off = Engine(loaded=loaded, progress=False, enable_prefix_caching=False, **DEFAULT_MODEL_KW)
    on = Engine(loaded=loaded, progress=False, debug_poison_freed_pages=True,
                host_kv_cache_memory=64 * off.kv_spec.bytes_per_page, **DEFAULT_MODEL_KW)
    convs = conversations(3)
    sp1 = SamplingParams(temperature=0, max_tokens=16)
    sp2 = SamplingParams(temperature=0, max_tokens=8)

    def chat(*turns):
        msgs = [{"role": "system", "content": SYSTEM}]
        for i, t in enumerate(turns):
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
        return tok.apply_chat_template(msgs, add_generation_prompt=True)

    results = {}
    for name, eng in (("off", off), ("on", on)):
        first = eng.generate([chat(c[0]) for c in convs], sp1)
        second = [chat(c[0], o.outputs[0].text, c[1]) for c, o in zip(convs, first)]
        last_page = [p[:-2] + [p[-1], p[-2]] for p in second]       # same but the last page
        outs = eng.generate(second + last_page, sp2)
        results[name] = [o.outputs[0].token_ids for o in first + outs]
        assert_clean(eng)
    assert results["on"] == results["off"]
    st = on.stats()
    turn2_tokens = sum(len(p) for p in second)
    assert st["prefix_cache_hits_total"] >= turn2_tokens // 2, st

"""Multi-LoRA (engine/lora.py, engine/lora_device.py, serving/lora_routes.py).

Oracles: adapters made by ``peft`` itself on tiny random-weight transformers models (B
initialised non-zero, so every delta matters), compared with the PEFT-merged model
(``merge_and_unload``): the engine's logits at every sampled position within 1e-4, and its
greedy tokens equal. Then what the engine adds: a step mixing three adapters and the base
model gives every request the bits it gets alone (with chunked prefill, preemption and
more adapters than device slots), a base request on a LoRA engine is the plain engine's
bits, adapters do not share prefix-cache pages, loading/unloading while serving loses no
request, and bad adapter directories are refused with the reason named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

import numpy as np
import pytest

import torch  # a declared dependency (test extras): missing it fails, never skips
import transformers  # a declared dependency (test extras): missing it fails, never skips
import peft  # a declared dependency (test extras): missing it fails, never skips

sys.path.insert(0, os.path.dirname(__file__))
from test_hf_oracle import TINY, Family, build_family  # noqa: E402

from jaxinfer.engine_config import EngineConfig  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine import lora as LR  # noqa: E402
from jaxinfer.engine.block_manager import BlockManager  # noqa: E402
from jaxinfer.engine.scheduler import Scheduler  # noqa: E402
from jaxinfer.engine.sequence import make_sequences  # noqa: E402

LOGIT_ATOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Small shapes: 4 rows, 32-token steps cut into two 16-position prefill slots (longer
# prompts are chunked), 12 pages of 16 tokens (requests of ~40 tokens preempt each other).
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=12,
                 page_buckets=(8,), min_sampler_rows=16, decode_buckets=(1, 4), mixed_decode_buckets=(0, 4),
                 prefill_buckets=((2, 16),), progress=False)


def build_base(cfg, out_dir: str):
    """A tiny random-weight HF model (float32, eval), saved with a tokenizer to ``out_dir``."""
    return build_family(Family("lora-base", lambda: cfg), out_dir)


def make_adapter(base_dir: str, out_dir: str, seed: int, r: int = 8, targets=ALL, scale: float = 0.15,
                 **lora_kw):
    """A random PEFT LoRA adapter of the model in ``base_dir`` (lora_B non-zero), saved to
    ``out_dir``; returns the PEFT-merged HF model (the oracle)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).float().eval()
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False,
                          **lora_kw)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


def llama_config():
    return transformers.LlamaConfig(**TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama and three adapters: all targets r=8, q/v only r=4, all targets rsLoRA r=8."""
    d = str(tmp_path_factory.mktemp("lora_llama"))
    base = build_base(llama_config(), d)
    merged = {"a1": make_adapter(d, f"{d}/a1", 1),
              "a2": make_adapter(d, f"{d}/a2", 2, r=4, targets=["q_proj", "v_proj"], scale=0.3),
              "a3": make_adapter(d, f"{d}/a3", 3, use_rslora=True)}
    return d, base, merged


@pytest.fixture(scope="module")
def engine(tiny):
    """Three adapters loaded, two device slots: a step holds at most two adapters and
    slots are swapped least-recently-used."""
    from jaxinfer.engine.engine import Engine

    d, _, _ = tiny
    return Engine(d, enable_lora=True, max_loras=2, max_lora_rank=8,
                  lora_modules={n: f"{d}/{n}" for n in ("a1", "a2", "a3")}, **ENGINE_KW)


def prompts(n: int, vocab: int, lens=(5, 23, 40, 61, 9, 33, 17, 50)) -> list[list[int]]:
    rng = np.random.RandomState(1)
    return [rng.randint(3, vocab, size=lens[i % len(lens)]).tolist() for i in range(n)]


def engine_logits(engine, ids: list[int], n: int, lora: str | None) -> tuple[list[int], np.ndarray]:
    """Greedy n tokens of one request driven step by step -> (tokens, the logits f32[n, V]
    of every sampled position, read from the runner)."""
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), "probe", lora=lora)
    rows, out = [], None
    dispatch = engine.runner.dispatch

    def spy(batch, *rest):              # the logits row (slot) of the request's sampled piece
        packed = dispatch(batch, *rest)
        # read now: the next step's forward takes this buffer over (donated), and the
        # overlapped loop dispatches it before this step's tokens come back
        rows.extend(np.asarray(engine.runner.last_logits[slot]) for slot, e in batch.entries if e.samples)
        return packed

    engine.runner.dispatch = spy
    try:
        while engine.has_unfinished():
            for o in engine.step():
                out = o
    finally:
        del engine.runner.dispatch
    rows = rows[:len(out.outputs[0].token_ids)]     # (a look-ahead step past the last token)
    return out.outputs[0].token_ids, np.stack(rows)


def hf_logits(model, ids: list[int], toks: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids + toks])).logits[0].numpy()
    return logits[len(ids) - 1:len(ids) - 1 + len(toks)]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# ------------------------------------------------------------------ numerics vs PEFT

@pytest.mark.parametrize("name", ["a1", "a2", "a3"])
def test_logits_match_peft_merged(engine, tiny, name):
    _, _, merged = tiny
    for ids in prompts(3, TINY["vocab_size"], lens=(7, 21, 37)):
        toks, logits = engine_logits(engine, ids, 6, name)
        assert toks == hf_greedy(merged[name], ids, 6), f"{name}: greedy tokens differ from PEFT-merged HF"
        err = np.abs(logits - hf_logits(merged[name], ids, toks)).max()
        assert err <= LOGIT_ATOL, f"{name}: logits differ from PEFT-merged HF by {err:.2e}"


def test_adapter_changes_the_output(engine, tiny):
    """The oracle can fail: the adapters' logits are far from the base model's."""
    _, base, merged = tiny
    ids = prompts(1, TINY["vocab_size"])[0]
    toks, logits = engine_logits(engine, ids, 6, "a1")
    assert np.abs(logits - hf_logits(base, ids, toks)).max() > 100 * LOGIT_ATOL
    base_toks, base_logits = engine_logits(engine, ids, 6, None)
    assert np.abs(base_logits - hf_logits(base, ids, base_toks)).max() <= LOGIT_ATOL


FAMILY_CONFIGS = {
    "qwen2-bias": (lambda: transformers.Qwen2Config(**TINY), ALL),
    "opt": (lambda: transformers.OPTConfig(vocab_size=TINY["vocab_size"], hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, ffn_dim=128, max_position_embeddings=256,
                                           bos_token_id=1, eos_token_id=2),
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_other_families_match_peft_merged(tmp_path, family):
    from jaxinfer.engine.engine import Engine

    make_cfg, targets = FAMILY_CONFIGS[family]
    d = str(tmp_path)
    build_base(make_cfg(), d)
    merged = make_adapter(d, f"{d}/ad", 5, targets=targets)
    eng = Engine(d, lora_modules={"ad": f"{d}/ad"}, max_loras=1, max_lora_rank=8,
                 **{**ENGINE_KW, "max_num_seqs": 1, "decode_buckets": (1,), "mixed_decode_buckets": (0,)})
    ids = prompts(1, TINY["vocab_size"], lens=(21,))[0]
    toks, logits = engine_logits(eng, ids, 5, "ad")
    assert toks == hf_greedy(merged, ids, 5)
    err = np.abs(logits - hf_logits(merged, ids, toks)).max()
    assert err <= LOGIT_ATOL, f"{family}: logits differ from PEFT-merged HF by {err:.2e}"


# ------------------------------------------------------------------ batching

def test_mixed_batch_matches_alone(engine, tiny):
    """Requests of three adapters and of the base model in one stream of steps (added a few
    at a time; chunked prefill; 12 pages force preemption; two slots for three adapters)
    get the same tokens and logprob bits as each alone."""
    from test_engine import COMPILES

    names = ["a1", None, "a2", "a3", "a1", None, "a3", "a2"]
    ps = prompts(len(names), TINY["vocab_size"])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = [engine.generate([p], sp, lora=n)[0].outputs[0] for p, n in zip(ps, names)]
    pre0 = engine.stats()["num_preemptions_total"]
    COMPILES.count, COMPILES.active = 0, True
    try:
        rng = np.random.RandomState(0)
        outs, i = {}, 0
        while i < len(ps) or engine.has_unfinished():
            for _ in range(rng.randint(0, 3)):
                if i < len(ps):
                    engine.add_request(ps[i], sp, f"m{i}", lora=names[i])
                    i += 1
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
    finally:
        COMPILES.active = False
    assert COMPILES.count == 0, "a step compiled after warm-up"
    assert engine.stats()["num_preemptions_total"] > pre0, "the test meant to preempt"
    for i, (a, n) in enumerate(zip(alone, names)):
        b = outs[f"m{i}"]
        assert b.token_ids == a.token_ids, f"request {i} ({n}): tokens differ alone vs batched"
        assert [(x.logprob, x.top) for x in b.logprobs] == [(x.logprob, x.top) for x in a.logprobs], \
            f"request {i} ({n}): logprobs are not the same bits alone and batched"
    assert len({tuple(alone[i].token_ids) for i in (0, 1, 2, 3)}) == 4, "adapters should give different tokens"
    st = engine.stats()
    assert st["num_free_pages"] == st["num_total_pages"], "KV pages leaked"


def test_base_request_is_the_plain_engine(engine, tiny):
    """No adapter on a LoRA engine: the bits of an engine without LoRA (and a request after
    an adapter's run of the same prompt does not reuse that run's prefix pages)."""
    from jaxinfer.engine.engine import Engine

    d, _, _ = tiny
    plain = Engine(d, **ENGINE_KW)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    for ids in prompts(3, TINY["vocab_size"], lens=(40, 9, 33)):
        engine.generate([ids], sp, lora="a1")
        hits = engine.stats()["prefix_cache_hits_total"]
        got = engine.generate([ids], sp)[0].outputs[0]
        assert engine.stats()["prefix_cache_hits_total"] == hits, "a base request reused an adapter's pages"
        want = plain.generate([ids], sp)[0].outputs[0]
        assert got.token_ids == want.token_ids
        assert [(x.logprob, x.top) for x in got.logprobs] == [(x.logprob, x.top) for x in want.logprobs]
    again = engine.stats()["prefix_cache_hits_total"]
    engine.generate([ids], sp, lora="a1")
    assert engine.stats()["prefix_cache_hits_total"] > again, "the same adapter should hit its own pages"


# ------------------------------------------------------------------ load / unload

def test_load_unload_while_serving(engine, tiny):
    """While requests of a1, a2 and the base model stream, a4 is loaded and a1 unloaded:
    every running request finishes with its alone tokens, a1 is refused afterwards, a4 and
    a reloaded a1 serve, and the unloaded adapter's registry entry goes with its last request."""
    from jaxinfer.engine.async_engine import AsyncEngine

    d, _, _ = tiny
    make_adapter(d, f"{d}/a4", 4)
    ps = prompts(6, TINY["vocab_size"])
    names = ["a1", "a2", None, "a1", "a2", None]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [engine.generate([p], sp, lora=n)[0].outputs[0].token_ids for p, n in zip(ps, names)]
    a1_id = engine.loras.acquire("a1")
    engine.loras.release(a1_id)

    async def run():
        aeng = AsyncEngine(engine)
        try:
            async def one(i):
                last = None
                async for out in aeng.generate(ps[i], sp, f"s{i}", lora=names[i]):
                    last = out
                return last.outputs[0]

            tasks = [asyncio.create_task(one(i)) for i in range(len(ps))]
            await asyncio.sleep(0.3)
            await aeng.load_lora("a4", f"{d}/a4")
            await aeng.unload_lora("a1")
            assert "a1" not in aeng.lora_names() and "a4" in aeng.lora_names()
            outs = await asyncio.gather(*tasks)
            with pytest.raises(ValueError, match="no adapter named 'a1'"):
                async for _ in aeng.generate(ps[0], sp, "late", lora="a1"):
                    pass
            a4 = await one_named(aeng, ps[0], sp, "a4")
            await aeng.load_lora("a1", f"{d}/a1")
            a1 = await one_named(aeng, ps[0], sp, "a1")
            return outs, a4, a1
        finally:
            await aeng.shutdown()

    outs, a4, a1 = asyncio.run(run())
    for i, o in enumerate(outs):
        assert o.finish_reason == "length" and o.token_ids == alone[i], f"request {i} ({names[i]}) changed"
    assert a1 == alone[0], "the reloaded adapter gives other tokens"
    assert a4 != alone[0]
    assert not engine.loras.is_live(a1_id), "the unloaded adapter outlived its last request"


async def one_named(aeng, ids, sp, name):
    last = None
    async for out in aeng.generate(ids, sp, f"n-{name}", lora=name):
        last = out
    return last.outputs[0].token_ids


# ------------------------------------------------------------------ bad adapters (host only)

@pytest.fixture(scope="module")
def good_adapter(tiny):
    return tiny[0] + "/a1"


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes) -> None:
    p = os.path.join(path, LR.CONFIG_FILE)
    conf = json.load(open(p))
    conf.update(changes)
    json.dump(conf, open(p, "w"))


def _edit_tensors(path: str, fn) -> None:
    from safetensors.numpy import load_file, save_file

    p = os.path.join(path, LR.WEIGHTS_FILE)
    save_file(fn(dict(load_file(p))), p)


def _model_cfg(tiny):
    from jaxinfer.loading import read_config

    return read_config(tiny[0])


BAD = {
    "missing config": (lambda p: os.remove(os.path.join(p, LR.CONFIG_FILE)), "adapter_config.json is missing"),
    "pickle weights": (lambda p: (os.rename(os.path.join(p, LR.WEIGHTS_FILE), os.path.join(p, "adapter_model.bin"))),
                       "adapter_model.bin is a pickle file and is never loaded"),
    "rank too large": (lambda p: _edit_config(p, r=32), r"r \(the rank\) must be an integer in \[1, 16\]"),
    "rank mismatch": (lambda p: _edit_config(p, r=4), r"do not fit rank r=4"),
    "wrong target shape": (lambda p: _edit_tensors(p, lambda t: {
        k: (v[:, :-1] if k.endswith("q_proj.lora_A.weight") else v) for k, v in t.items()}),
        r"q_proj: lora_A \(8, 63\).*want A \(8, 64\)"),
    "DoRA": (lambda p: _edit_config(p, use_dora=True), "option use_dora is set; it is not supported"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "option modules_to_save"),
    "not LoRA": (lambda p: _edit_config(p, peft_type="IA3"), "peft_type must be 'LORA'"),
    "unknown module": (lambda p: _edit_tensors(p, lambda t: {
        k.replace("layers.1.mlp.down_proj", "layers.1.mlp.zzz_proj"): v for k, v in t.items()}),
        "module 'model.layers.1.mlp.zzz_proj' is not a LoRA target"),
    "half a pair": (lambda p: _edit_tensors(p, lambda t: {
        k: v for k, v in t.items() if not k.endswith("layers.0.mlp.up_proj.lora_B.weight")}),
        "up_proj has lora_A but not both"),
    "embedding weights": (lambda p: _edit_tensors(p, lambda t: {
        **t, "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 384), np.float32)}),
        "is not a LoRA A/B weight"),
    "NaN": (lambda p: _edit_tensors(p, lambda t: {
        k: (np.full_like(v, np.nan) if "layers.0.self_attn.k_proj.lora_B" in k else v) for k, v in t.items()}),
        "NaN or infinite"),
    "corrupt file": (lambda p: open(os.path.join(p, LR.WEIGHTS_FILE), "r+b").write(b"\xff" * 16),
                     "corrupt or unreadable safetensors"),
    "oversized file": (lambda p: open(os.path.join(p, LR.WEIGHTS_FILE), "ab").write(b"\0" * (3 << 20)),
                       "is more than any adapter of rank <= 16"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_refused(tiny, good_adapter, tmp_path, case):
    damage, message = BAD[case]
    path = _copy(good_adapter, str(tmp_path / "ad"))
    damage(path)
    with pytest.raises(LR.LoraError, match=message):
        LR.read_adapter(path, _model_cfg(tiny), 16)


def test_good_adapter_reads(tiny, good_adapter):
    """The damage above is what fails: the intact copy reads, with scaling folded into B."""
    data = LR.read_adapter(good_adapter, _model_cfg(tiny), 16)
    assert data.rank == 8 and len(data.weights) == 7 * TINY["num_hidden_layers"]
    a, b = data.weights["layers.0.wq"]
    assert a.shape == (64, 8) and b.shape == (8, 64) and np.abs(b).max() > 0


def test_paths_and_names_refused(tiny, good_adapter, tmp_path):
    cfg = _model_cfg(tiny)
    with pytest.raises(LR.LoraError, match="is not a directory"):
        LR.read_adapter(str(tmp_path / "nope"), cfg, 16)
    with pytest.raises(LR.LoraError, match="is a file"):
        LR.read_adapter(os.path.join(good_adapter, LR.WEIGHTS_FILE), cfg, 16)
    reg = LR.LoraRegistry(cfg, 16, 2)
    for bad_name in ("", "has space", "x" * 129, "../up", None):
        with pytest.raises(LR.LoraError, match="lora_name"):
            reg.load(bad_name, good_adapter)
    reg.load("x", good_adapter)
    with pytest.raises(LR.LoraError, match="already loaded"):
        reg.load("x", good_adapter)
    reg.load("y", good_adapter)
    with pytest.raises(LR.LoraError, match="--max-cpu-loras"):
        reg.load("z", good_adapter)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=65)
    with pytest.raises(ValueError, match="lora_modules"):
        EngineConfig(lora_modules=(("", "/x"),))


# ------------------------------------------------------------------ host bookkeeping

def test_registry_keeps_unloaded_adapter_until_released(tiny, good_adapter):
    reg = LR.LoraRegistry(_model_cfg(tiny), 16, 4)
    reg.load("a", good_adapter)
    i = reg.acquire("a")
    reg.remove("a")
    assert reg.names() == [] and reg.is_live(i)
    with pytest.raises(LR.LoraError, match="no adapter named 'a'"):
        reg.acquire("a")
    reg.load("a", good_adapter)
    j = reg.acquire("a")
    assert j != i, "a reload must get a new id (prefix-cache pages of the old one must not match)"
    reg.release(i)
    assert not reg.is_live(i) and reg.is_live(j)
    reg.release(j)
    assert reg.is_live(j), "a loaded adapter stays while unreferenced"


def test_slot_table_lru():
    t = LR.SlotTable(2)
    slot_of, loads = t.assign({0, 7})
    assert slot_of == {0: 0, 7: 1} and loads == [(1, 7)]
    slot_of, loads = t.assign({8})
    assert slot_of == {8: 2} and loads == [(2, 8)]
    slot_of, loads = t.assign({7})            # resident: no load; 7 becomes most recent
    assert slot_of == {7: 1} and loads == []
    slot_of, loads = t.assign({9, 7})         # 8 is least recently used and unused now
    assert slot_of == {9: 2, 7: 1} and loads == [(2, 9)]
    with pytest.raises(RuntimeError, match="3 adapters in one step"):
        t.assign({1, 2, 3})


def test_scheduler_admits_at_most_max_loras_adapters():
    bm = BlockManager(64, 16, False)
    s = Scheduler(bm, 8, 256, 128, max_loras=2)
    sp = SamplingParams(max_tokens=4)
    for i, lid in enumerate([1, 2, 3, 0, 1]):
        s.add(make_sequences(f"r{i}", [5] * 8, sp, lora_id=lid))
    out = s.schedule()
    assert sorted(e.seq.request_id for e in out.scheduled) == ["r0", "r1", "r3", "r4"]
    assert [q.request_id for q in s.waiting] == ["r2"]
    for seq in list(s.running):
        if seq.lora_id == 2:
            s.finish(seq, "stop")
    s.postprocess(out, {e.seq.seq_id: 9 for e in out.scheduled if e.seq.status.value == "running"})
    assert "r2" in [e.seq.request_id for e in s.schedule().scheduled]


def test_prefix_hash_differs_per_adapter():
    bm = BlockManager(64, 16, True)
    sp = SamplingParams(max_tokens=4)
    chains = [bm._hashes(make_sequences("r", list(range(40)), sp, lora_id=i)[0], 2) for i in (0, 1, 2)]
    assert len({tuple(c) for c in chains}) == 3


# ------------------------------------------------------------------ HTTP

@contextlib.contextmanager
def _served(engine, **app_kw):
    """``engine`` behind a real server (``build_app(**app_kw)``) -> an httpx client on it."""
    import httpx

    from jaxinfer.engine.async_engine import AsyncEngine
    from mock_engine import serve_in_thread
    from serving.app import build_app

    aeng = AsyncEngine(engine)
    try:
        with serve_in_thread(build_app(aeng, **app_kw)) as url, httpx.Client(base_url=url, timeout=120) as http:
            yield http
    finally:
        asyncio.run(aeng.shutdown())


def _complete(http, model: str, ids: list[int]):
    return http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True})


def _load(http, name: str, path: str):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_serving_routes(engine, tiny, tmp_path):
    """Adapters over HTTP: /v1/models lists them (parent: the base model); model=<adapter>
    (OpenAI) and adapter_id (TGI) give the engine's own tokens for that adapter; load /
    unload routes, with bad directories and unknown names refused in the API's error shape."""
    d, _, _ = tiny
    ids = prompts(1, len(engine.tokenizer), lens=(19,))[0]     # ids the server's tokenizer knows
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {n: engine.generate([ids], sp, lora=n)[0].outputs[0].text for n in ("a2", None)}
    allowed = str(tmp_path)                                      # --lora-dir
    bad_dir = _copy(f"{d}/a2", f"{allowed}/pickled")
    os.rename(os.path.join(bad_dir, LR.WEIGHTS_FILE), os.path.join(bad_dir, "adapter_model.bin"))
    good_dir = _copy(f"{d}/a2", f"{allowed}/a2")
    with _served(engine, lora_dirs=[allowed]) as http:
        models = http.get("/v1/models").json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m["parent"]) for m in models] == [(base, None)] + [
            (n, base) for n in engine.lora_names()]

        def complete(model):
            return _complete(http, model, ids)

        r = complete("a2")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["a2"]
        assert complete(base).json()["choices"][0]["text"] == want[None]
        r = http.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "nope"}})
        assert r.status_code == 422 and "adapter_id" in r.json()["error"]
        r = complete("nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"

        r = _load(http, "p", bad_dir)
        assert r.status_code == 400 and "pickle" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "p"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = _load(http, "b2", good_dir)
        assert r.status_code == 200, r.text
        assert "b2" in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert complete("b2").json()["choices"][0]["text"] == want["a2"]
        tgi = http.post("/generate", json={"inputs": engine.tokenizer.decode(ids), "parameters": {
            "adapter_id": "b2", "max_new_tokens": 4}})
        assert tgi.status_code == 200, tgi.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b2"}).status_code == 200
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "b2"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        r = complete("b2")
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_load_route_confined_to_lora_dirs(engine, tiny, tmp_path):
    """Over HTTP an adapter loads only from under --lora-dir: every path outside it (missing,
    a file, a directory, a real adapter, a symlink out of it, '..') gets the very same
    answer, so the route is no file-system oracle; inside it, a relative name loads and
    serves; with no --lora-dir at all, loading by path is refused."""
    d, _, _ = tiny
    ids = prompts(1, len(engine.tokenizer), lens=(19,))[0]
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    real_outside = _copy(f"{d}/a2", str(outside / "ad"))
    os.symlink(real_outside, allowed / "link_out")
    os.symlink("/etc", allowed / "etc_link")
    _copy(f"{d}/a2", str(allowed / "good"))
    refused = ["/etc/passwd", "/etc", "/nonexistent", real_outside, str(allowed / "link_out"),
               f"{allowed}/../outside/ad", "../outside/ad", "etc_link/passwd", "/etc/passwd\0x"]
    before = engine.lora_names()
    with _served(engine, lora_dirs=[str(allowed)]) as http:
        answers = {p: _load(http, "x", p) for p in refused}
        assert {(r.status_code, r.text) for r in answers.values()} == {(400, answers["/etc"].text)}, {
            p: r.text for p, r in answers.items()}
        err = answers["/etc"].json()["error"]
        assert err == {"message": LR.OUTSIDE_ALLOWED, "type": err["type"], "param": "lora_path",
                       "code": "invalid_lora_adapter"}
        assert engine.lora_names() == before
        r = _load(http, "good", "good")                   # relative: under the first --lora-dir
        assert r.status_code == 200, r.text
        try:
            got = _complete(http, "good", ids)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == _complete(http, "a2", ids).json()["choices"][0]["text"]
        finally:
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    with _served(engine) as http:                          # no --lora-dir: off
        r = _load(http, "good", str(allowed / "good"))
        assert r.status_code == 400 and "--lora-dir" in r.json()["error"]["message"], r.text
    assert engine.lora_names() == before


SECRET = "SECRET-peft-type-xyzzy"
# adapter_config.json damage inside the allowed directory -> what the 400 says.
BAD_CONFIG_FILES = {
    "a directory": (lambda p: os.mkdir(p), "is not a regular file"),
    "a symlink loop": (lambda p: os.symlink(p, p), "cannot be read"),
    "invalid UTF-8": (lambda p: open(p, "wb").write(b'{"peft_type": "\xff\xfe"}'), "is not UTF-8 text"),
    "not JSON": (lambda p: open(p, "w").write("peft_type = LORA"), "is not valid JSON"),
    "nested past the recursion limit": (lambda p: open(p, "w").write("[" * 200_000), "is not valid JSON"),
    "wrong peft_type": (lambda p: json.dump({"peft_type": SECRET, "r": 8, "lora_alpha": 16}, open(p, "w")),
                        "peft_type must be 'LORA'"),
}


def test_load_route_bad_config_is_400(engine, tiny, tmp_path):
    """Inside --lora-dir, an adapter_config.json that cannot be read or parsed is a 400 in
    OpenAI's error shape naming the problem (never a 500, never the file's text), and the
    engine keeps serving."""
    d, _, _ = tiny
    ids = prompts(1, len(engine.tokenizer), lens=(19,))[0]
    for case, (damage, _) in BAD_CONFIG_FILES.items():
        path = _copy(f"{d}/a1", str(tmp_path / case.replace(" ", "_")))
        os.remove(os.path.join(path, LR.CONFIG_FILE))
        damage(os.path.join(path, LR.CONFIG_FILE))
    with _served(engine, lora_dirs=[str(tmp_path)]) as http:
        for case, (_, message) in BAD_CONFIG_FILES.items():
            r = _load(http, "x", case.replace(" ", "_"))
            assert r.status_code == 400, (case, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == "lora_path", (case, err)
            assert message in err["message"] and SECRET not in r.text, (case, err)
        assert "x" not in engine.lora_names()
        r = _complete(http, "a1", ids)
        assert r.status_code == 200, r.text


def test_lora_dirs_checked_and_passed_on(tmp_path, monkeypatch):
    """--lora-dir is repeatable and reaches the app; a dir that is not one is refused at start."""
    import serving.server
    from serving.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--lora-dir", str(tmp_path), "--lora-dir", "/x"])
    seen = {}
    monkeypatch.setattr(serving.server, "run_server", lambda engine, **kw: seen.update(kw) or 0)
    assert serving.server.serve_main(args, engine=object()) == 0
    assert seen["lora_dirs"] == [str(tmp_path), "/x"]
    assert LR.allowed_dirs([str(tmp_path)]) == (os.path.realpath(tmp_path),)
    for bad in ("/nonexistent", os.path.realpath(__file__), ""):
        with pytest.raises(ValueError, match="lora_dirs"):
            LR.allowed_dirs([bad])


# ------------------------------------------------------------------ tensor / data parallel

def test_tensor_and_data_parallel(tmp_path):
    """Adapters sharded like their weights (TP 2, TP 4 with repeated KV heads, DP 2 x TP 2,
    8 virtual CPU devices in a subprocess): every run gives TP 1's tokens and logits (within
    1e-5 relative) for a mix of three adapters and the base model, and a TP 2 step holds the
    same collectives with LoRA as without (the partial deltas ride the weights' all-reduces;
    both unrolled: LoRA unrolls the layers)."""
    import subprocess

    from test_parallel import ROOT, _cache_args, _env

    d = str(tmp_path)
    build_base(transformers.LlamaConfig(**{**TINY, "num_attention_heads": 8, "num_key_value_heads": 2}), d)
    for i, n in enumerate(("a1", "a2", "a3")):
        make_adapter(d, f"{d}/{n}", 10 + i, r=8 if i != 1 else 4)
    worker = os.path.join(os.path.dirname(__file__), "lora_tp_worker.py")
    p = subprocess.run([sys.executable, worker, d, *_cache_args()], capture_output=True, text=True,
                       timeout=1500, env=_env(), cwd=ROOT)
    assert p.returncode == 0, f"worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    ref = res["1x1"]
    for key in ("1x2", "1x4", "2x2"):
        r = res[key]
        assert r["tokens"] == ref["tokens"], key
        assert not r["leaked_pages"], key
        for a, b in zip(r["logits"], ref["logits"]):
            a, b = np.asarray(a), np.asarray(b)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), key
    assert ref["tokens"][0] != res["plain_1x2"]["tokens"][0], "adapter a1 should change request 0's tokens"
    assert ref["tokens"][1] == res["plain_1x2"]["tokens"][1], "a base request must keep the base tokens"
    with_lora, plain = res["1x2"]["hlo"]["buckets"], res["plain_1x2"]["hlo"]["buckets"]
    assert with_lora.keys() == plain.keys() and with_lora
    for b in plain:
        for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            assert with_lora[b][op] == plain[b][op], (b, op, with_lora[b][op], plain[b][op])


# ------------------------------------------------------------------ the default model

@pytest.mark.slow
def test_default_model_adapter_matches_peft_merged(tmp_path, default_gguf_path):
    """SmolLM2 (transformers' own GGUF reader, as tests/test_default_model.py) with a random
    rank-16 PEFT adapter on all seven targets: greedy tokens equal the PEFT-merged model's and
    every sampled position's logits are within 1e-4 of its (relative to the largest, as the
    default model's own oracle measures), alone and next to a base request."""
    from test_default_model import hf_default_model

    from jaxinfer.engine.engine import Engine
    from test_engine import DEFAULT_MODEL_ENGINE_KW

    hf = hf_default_model()
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=ALL, init_lora_weights=False)
    model = peft.get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(str(tmp_path / "ad"))
    merged = model.merge_and_unload().eval()
    eng = Engine(lora_modules={"ad": str(tmp_path / "ad")}, max_loras=1, max_lora_rank=16,
                 progress=False, **DEFAULT_MODEL_ENGINE_KW)
    tok = eng.tokenizer
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about the sea."}]]
    base_toks = None
    for msgs in chats:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        toks, logits = engine_logits(eng, ids, 12, "ad")
        assert toks == hf_greedy(merged, ids, 12)
        ref = hf_logits(merged, ids, toks)
        rel = np.abs(logits - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, rel
        base_toks = eng.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
        assert base_toks != toks, "the adapter should change the default model's reply"
    sp = SamplingParams(temperature=0, max_tokens=12)
    pair = eng.generate([ids, ids], sp, lora=["ad", None])
    assert [o.outputs[0].token_ids for o in pair] == [toks, base_toks]

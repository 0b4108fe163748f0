"""The server, started for real under uvicorn on a loopback port, against MockAsyncEngine.

Driven by the official ``openai`` client and httpx. The mock's outputs are known in
advance (``MockAsyncEngine.expected_text``), so every answer is checked exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import CORPUS, CharTokenizer, MockAsyncEngine, free_port, serve_in_thread  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from serving.app import build_app  # noqa: E402

MODEL = "mock-model"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server():
    engine = MockAsyncEngine(max_num_seqs=16, max_waiting=128, step_time=0.002, max_model_len=320)
    app = build_app(engine)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, app=app)
    assert app.state.jx.internal_errors == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def chat_ids(engine, content):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def sse_events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------------- OpenAI routes

def test_completion(server, client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12, temperature=0)
    want = server.engine.expected_text("Hello world", greedy(12))
    assert r.choices[0].text == want and len(want) == 12
    assert r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.model == MODEL
    n_prompt = len(server.engine.tokenizer.encode("Hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_completion_prompt_forms(server, client):
    """A string, a list of one string, token ids and a list of one token-id list agree."""
    tok = server.engine.tokenizer
    ids = tok.encode("Token ids")
    texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in ("Token ids", ["Token ids"], ids, [ids])]
    assert len(set(texts)) == 1
    assert texts[0] == server.engine.expected_text(ids, greedy(8))


def test_chat(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                       max_completion_tokens=10, temperature=0)
    ids = chat_ids(server.engine, "Hi there")
    assert r.choices[0].message.content == server.engine.expected_text(ids, greedy(10))
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    # max_tokens works too; content parts and a system message go through the template
    r2 = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}])
    assert r2.usage.completion_tokens == 5


def test_chat_default_max_tokens_fills_context(server, client):
    """Without max_tokens a chat request may use the rest of the context (ignore_eos keeps it going)."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == server.engine.max_model_len
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stop", [None, ["painted"]])
def test_streaming_equals_non_streamed(server, client, stop):
    prompt = "Stream me please"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert len(chunks) > 3          # really streamed, not one blob

    msgs = [{"role": "user", "content": prompt}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=stop)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                                 stop=stop, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    # vLLM's continuous_usage_stats: every chunk carries the tokens so far (never fewer than
    # the previous chunk's, never more than the final count)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                                 stop=stop, stream=True, stream_options={
                                                     "include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens and counts[0] < counts[-1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_stream_ends_with_done(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(isinstance(e, dict) and "usage" not in e for e in events[:-1])


def test_n2(server, client):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2)
    r = client.completions.create(model=MODEL, prompt="Two please", max_tokens=12, temperature=0.8,
                                  seed=7, n=2)
    got = {c.index: c.text for c in r.choices}
    assert got == {i: server.engine.expected_text("Two please", params, i) for i in (0, 1)}
    assert got[0] != got[1]
    assert r.usage.completion_tokens == 24
    chunks = list(client.completions.create(model=MODEL, prompt="Two please", max_tokens=12, temperature=0.8,
                                            seed=7, n=2, stream=True))
    streamed = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == got
    rc = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=6, temperature=0, n=2)
    assert [c.index for c in rc.choices] == [0, 1]
    assert rc.choices[0].message.content == rc.choices[1].message.content   # greedy: identical


def test_stop(server, client):
    prompt = "Stop somewhere"
    free = server.engine.expected_text(prompt, greedy(30))
    stop = free[10:14]
    want = free[:free.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == want + stop


def test_eos_finishes_with_stop(server, client):
    n = len(CORPUS)
    tid = n * 10 + n - 3          # sum % n == n - 3: three corpus characters, then EOS
    assert tid >= CharTokenizer.OFFSET
    r = client.completions.create(model=MODEL, prompt=[tid], max_tokens=20, temperature=0)
    assert r.choices[0].text == CORPUS[-3:]
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    r = client.completions.create(model=MODEL, prompt=[tid], max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20


def test_completion_logprobs(server, client):
    r = client.completions.create(model=MODEL, prompt="Log me", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 8 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs))
    assert lp.text_offset == list(range(8))
    chunks = list(client.completions.create(model=MODEL, prompt="Log me", max_tokens=8, temperature=0,
                                            logprobs=3, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(server, client):
    msgs = [{"role": "user", "content": "Log me"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_echo(server, client):
    r = client.completions.create(model=MODEL, prompt="Echo: ", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == "Echo: " + server.engine.expected_text("Echo: ", greedy(5))
    chunks = list(client.completions.create(model=MODEL, prompt="Echo: ", max_tokens=5, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_sampling_parameters_accepted(server, client):
    r = client.completions.create(
        model=MODEL, prompt="params", max_tokens=4, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [2]})
    assert r.usage.completion_tokens == 4
    again = client.completions.create(
        model=MODEL, prompt="params", max_tokens=4, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [2]})
    assert again.choices[0].text == r.choices[0].text     # same seed, same sample


def test_models(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_openai_client_sees_bad_request(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "model" in str(e.value)


# ---------------------------------------------------------------------- TGI routes

def test_tgi_generate(server):
    want = server.engine.expected_text("TGI prompt", greedy(7))
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/generate", json={"inputs": "TGI prompt", "parameters": {"max_new_tokens": 7}})
        assert r.status_code == 200 and r.json() == {"generated_text": want}
        r = c.post("/generate", json={"inputs": "TGI prompt", "parameters": {
            "max_new_tokens": 7, "details": True, "return_full_text": True, "top_n_tokens": 2}})
        body = r.json()
        assert body["generated_text"] == "TGI prompt" + want
        d = body["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == 7 and d["seed"] is None
        assert "".join(t["text"] for t in d["tokens"]) == want
        assert all(len(t) == 2 for t in d["top_tokens"])
        r = c.post("/generate", json={"inputs": "TGI prompt", "parameters": {
            "max_new_tokens": 7, "do_sample": True, "details": True}})
        assert isinstance(r.json()["details"]["seed"], int)       # TGI reports the seed it drew
        r = c.post("/generate", json={"inputs": "TGI prompt", "parameters": {
            "max_new_tokens": 30, "stop": [want[3:5]], "details": True}})
        assert r.json()["details"]["finish_reason"] == "stop_sequence"
        assert r.json()["generated_text"] == want[:want.find(want[3:5])]
        with c.stream("POST", "/generate_stream", json={"inputs": "TGI prompt",
                                                        "parameters": {"max_new_tokens": 7}}) as s:
            events = sse_events(s.iter_lines())
    assert [e["index"] for e in events] == list(range(1, 8))
    assert "".join(e["token"]["text"] for e in events) == want
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == want
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 7
    assert all(isinstance(e["token"]["logprob"], float) for e in events)


def test_openapi_schema(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=5).json()
    assert schema["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["required"] == ["messages"]


def test_tgi_info(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        info = c.get("/info").json()
    assert info["model_id"] == MODEL and info["max_total_tokens"] == server.engine.max_model_len


# ---------------------------------------------------------------------- health and metrics

def test_health_states():
    engine = MockAsyncEngine(ready=False)
    app = build_app(engine)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=5) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming_up"
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        engine.is_ready = True
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        engine.kill()
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "dead"
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_engine_death_mid_request():
    engine = MockAsyncEngine(step_time=0.01, max_model_len=512)
    app = build_app(engine)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=5) as c:
        body = {"prompt": "doomed", "max_tokens": 300, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            engine.kill()
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"

    engine = MockAsyncEngine(step_time=0.01, max_model_len=512)
    app2 = build_app(engine)
    with serve_in_thread(app2) as url, httpx.Client(base_url=url, timeout=5) as c:
        import threading
        threading.Timer(0.2, engine.kill).start()
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert c.get("/health").status_code == 503
    assert app.state.jx.internal_errors == 0 and app2.state.jx.internal_errors == 0


def test_health_while_factory_loads():
    def factory():
        time.sleep(0.4)        # a blocking load runs in a worker thread
        return MockAsyncEngine()

    app = build_app(engine_factory=factory)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=5) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        assert wait_for(lambda: c.get("/health").status_code == 200)
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_finished_requests_are_not_aborted(server, client):
    """The server runs each engine generator to its end: closing it after the last output
    would make the engine see an abort (an extra round trip, and a wrong abort count)."""
    before = len(server.engine.abort_calls)
    client.completions.create(model=MODEL, prompt="done", max_tokens=3)
    list(client.completions.create(model=MODEL, prompt="done", max_tokens=3, stream=True))
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        stream=True, stream_options={"include_usage": True}))
    with httpx.Client(base_url=server.url, timeout=10) as c:
        c.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        with c.stream("POST", "/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}) as r:
            r.read()
    assert server.engine.abort_calls[before:] == []


def test_failed_engine_load_exits_1():
    from serving.server import run_server

    def factory():
        raise FileNotFoundError("no such model: /nowhere")

    codes: list[int] = []       # in a thread, so a server that never exits fails instead of hanging
    runner = threading.Thread(target=lambda: codes.append(
        run_server(factory, port=free_port(), log_level="critical", access_log=False)), daemon=True)
    runner.start()
    runner.join(60)
    assert codes == [1], "run_server did not exit 1 after the engine failed to load"


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_success_total"):
        assert f"jaxinfer:{name}" in text, name
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples[f'jaxinfer:time_to_first_token_seconds_count{{model_name="{MODEL}"}}'] >= 1
    assert samples[f'jaxinfer:request_success_total{{finish_reason="length",model_name="{MODEL}"}}'] >= 1
    gen = samples[f'jaxinfer:generation_tokens_total{{model_name="{MODEL}"}}']
    assert gen == server.engine.stats()["generation_tokens_total"]


# ---------------------------------------------------------------------- concurrency and cancellation

def test_64_concurrent_streams(server):
    engine = server.engine

    async def one(aclient, i):
        prompt = f"Concurrent prompt number {i}"
        text = ""
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
        return text == engine.expected_text(prompt, greedy(24))

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=30) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    assert all(asyncio.run(main()))
    assert wait_for(lambda: engine.stats()["num_free_pages"] == engine.stats()["num_total_pages"])


def test_stream_disconnect_aborts_and_frees_pages(server):
    engine = server.engine
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Long stream", "max_tokens": 250,
                                                       "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["id"].removeprefix("cmpl-")
            assert engine.stats()["num_free_pages"] < engine.stats()["num_total_pages"]
        # leaving the block closes the connection mid-stream
    assert wait_for(lambda: rid in engine.aborted)
    assert rid not in engine.finished
    assert wait_for(lambda: engine.stats()["num_free_pages"] == engine.stats()["num_total_pages"])
    assert engine.stats()["num_running"] == 0
    text = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'jaxinfer:request_success_total{finish_reason="abort"' in text


def test_non_streaming_disconnect_aborts():
    engine = MockAsyncEngine(step_time=0.01, max_model_len=512)
    app = build_app(engine)
    with serve_in_thread(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "slow", "max_tokens": 300,
                                                               "ignore_eos": True}, timeout=0.3)
        assert wait_for(lambda: len(engine.aborted) == 1)
        assert engine.finished == []
        assert wait_for(lambda: engine.stats()["num_free_pages"] == engine.stats()["num_total_pages"])
        # ... and a request still waiting in the queue when its client leaves is dropped too
        engine.paused = True
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", timeout=0.3, json={
                "messages": [{"role": "user", "content": "queued"}], "max_tokens": 5, "stream": True})
        assert wait_for(lambda: len(engine.aborted) == 2)
        assert engine.stats()["num_waiting"] == 0
        engine.paused = False
        assert app.state.jx.internal_errors == 0


def test_sse_response_aborts_when_headers_cannot_be_sent():
    """If the client is gone before the stream starts, the engine's request is still aborted."""
    from serving.app import SSEResponse, close_gen

    async def main():
        engine = MockAsyncEngine()
        gen = engine.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "r1")
        await gen.__anext__()

        async def body():
            yield b"never sent"

        async def send(message):
            raise OSError("client gone")

        async def receive():
            return {"type": "http.disconnect"}

        await SSEResponse(body(), on_close=lambda: close_gen(gen))({}, receive, send)
        aborted = list(engine.aborted)
        await engine.shutdown()
        return engine, aborted

    engine, aborted = asyncio.run(main())
    assert aborted == ["r1"] and engine.finished == []
    assert engine.num_free_pages == engine.num_total_pages


# ---------------------------------------------------------------------- graceful shutdown

def _start_mock_server(*args):
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "mock_engine.py"), "--port", str(port),
                             "--log-level", "warning", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_for(up, timeout=20):
        proc.kill()
        raise AssertionError("mock server did not start: " + proc.communicate()[0])
    return proc, url


@contextlib.contextmanager
def _stream_then_sigterm(proc, url: str, max_tokens: int):
    """A completion stream to the server ``proc``; SIGTERM once its first chunk is in ->
    the stream's remaining lines."""
    with httpx.Client(timeout=10) as c, \
            c.stream("POST", url + "/v1/completions", json={"prompt": "bye", "max_tokens": max_tokens,
                                                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        yield lines


def test_sigterm_finishes_in_flight_then_exits_0():
    proc, url = _start_mock_server("--step-time", "0.01", "--shutdown-timeout", "10")
    try:
        with _stream_then_sigterm(proc, url, max_tokens=40) as lines:
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):     # no longer accepting
                httpx.get(url + "/health", timeout=1)
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_sigterm_cancels_in_flight_after_timeout_then_exits_0():
    # 400 tokens take 20 s at 0.05 s a step: an exit within the 10 s wait is the cancel
    proc, url = _start_mock_server("--step-time", "0.05", "--shutdown-timeout", "0.5")
    try:
        with _stream_then_sigterm(proc, url, max_tokens=400) as lines:
            events = []                 # kept as they come: the server may cut mid-chunk
            try:
                for line in lines:
                    events += sse_events([line])
            except httpx.HTTPError:
                pass
        assert "[DONE]" not in events
        # cancelled, not finished: far fewer than the 400 tokens, none with a finish reason
        chunks = [e for e in events if isinstance(e, dict)]
        assert len(chunks) < 300, len(chunks)
        assert not any(c["choices"][0].get("finish_reason") for c in chunks), chunks[-1:]
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


# ---------------------------------------------------------------------- benchmarks/serve.py

def test_benchmark_script_against_mock(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(REPO, "benchmarks", "serve.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = bench          # dataclasses look their module up there
    spec.loader.exec_module(bench)
    engine = MockAsyncEngine(max_num_seqs=8, max_model_len=8192, step_time=0.002)
    with serve_in_thread(build_app(engine)) as url:
        out = tmp_path / "sweep.json"
        rc = bench.main(["--base-url", url, "--num-prompts", "8", "--max-tokens", "8",
                         "--sweep-rates", "50,200", "--output-json", str(out)])
        assert rc == 0
        report = json.loads(out.read_text())
        assert report["config"]["dataset"].endswith("mt_bench_questions.jsonl") or \
            report["config"]["dataset"] == "synthetic"
        assert [r["request_rate"] for r in report["results"]] == [50.0, 200.0]
        for r in report["results"]:
            assert r["completed"] == 8 and r["failed"] == 0 and r["total_output_tokens"] == 64
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
                assert r[key]["median"] > 0 and r[key]["p99"] >= r[key]["median"]
        if report.get("plot"):
            assert os.path.getsize(report["plot"]) > 0
        rc = bench.main(["--base-url", url, "--num-prompts", "6", "--max-tokens", "4", "--max-concurrency", "2",
                         "--endpoint", "completions", "--dataset", str(tmp_path / "missing.jsonl")])
        assert rc == 0

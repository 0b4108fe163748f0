"""The server's promises against the REAL engine (issue #24), not tests/mock_engine.py: the
API key (from the environment, as ``jaxinfer serve`` resolves it), the body limit (413),
overload (503 with Retry-After), the TGI routes, ``echo``, chat logprobs, /metrics counters,
and SIGTERM with requests in flight (a server process of its own).

Outputs are compared with the same engine driven in-process (its loop idles meanwhile), so
what crosses HTTP is checked value by value: token ids, text, logprobs. The tiny model of
tests/tiny_server.py serves (its executables are shared with test_serving_hardening.py
through the session's compilation cache)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import jax
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import free_port, serve_in_thread  # noqa: E402
from test_serving import sse_events, wait_for  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from serving.cli import resolve_api_key  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from serving.app import build_app  # noqa: E402

KEY = "k3y-from-env"
MAX_BODY = 8 * 1024
MAX_WAITING = 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine(max_waiting=MAX_WAITING)
    key = resolve_api_key(SimpleNamespace(api_key=None, api_key_file=None), {"JAXINFER_API_KEY": KEY})
    app = build_app(aeng, api_key=key, max_body_bytes=MAX_BODY)
    with serve_in_thread(app) as url, \
            httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as http:
        yield SimpleNamespace(url=url, app=app, aeng=aeng, http=http,
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60))
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


def in_process(server, prompt, params: SamplingParams):
    """The same engine driven directly while its loop idles -> (prompt ids, CompletionOutput)."""
    with server.aeng._wake:
        engine = server.aeng.engine
        assert not server.aeng._inbox and not engine.has_unfinished()
        _, ids = engine.encode_prompt(prompt)
        out = engine.generate([ids], params)[0].outputs[0]
        assert not engine.has_unfinished()
    return ids, out


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def metric_samples(server) -> dict[str, float]:
    text = server.http.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


# ---------------------------------------------------------------------- API key, body limit

def test_api_key_from_env_guards_every_route(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    routes = [("POST", "/v1/completions", body),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
              ("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
              ("GET", "/v1/models", None), ("GET", "/info", None)]
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        for method, path, js in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
                r = anon.request(method, path, json=js, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
            ok = anon.request(method, path, json=js, headers={"authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, (path, ok.text)
        assert anon.get("/health").status_code == 200 and anon.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_body_limit_413(server):
    big = {"model": MODEL_NAME, "prompt": "x" * (2 * MAX_BODY)}
    r = server.http.post("/v1/completions", json=big)
    assert r.status_code == 413 and "larger than the limit" in r.json()["error"]["message"]

    def chunks():            # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"y" * MAX_BODY
        yield b'"}'

    r = server.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = server.http.post("/generate", json={"inputs": "x" * (2 * MAX_BODY)})
    assert r.status_code == 413 and r.json()["error_type"] == "validation"
    # under the limit but longer than the model's context: the engine's 400, on the prompt
    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x " * 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------------- overload

def test_overload_burst_gets_503_the_rest_complete(server):
    """16 requests at once at an engine holding 4 running + 2 waiting: each one completes
    with all its tokens or gets a clean 503 (queue_full, Retry-After); nothing is lost."""
    n, max_tokens = 16, 48
    before = metric_samples(server)

    async def one(c, i):
        body = {"model": MODEL_NAME, "prompt": f"burst {i}", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        r = await c.post("/v1/completions", json=body)
        if r.status_code == 503:
            assert r.headers.get("Retry-After") == "1" and r.json()["error"]["code"] == "queue_full"
            return "503"
        assert r.status_code == 200, r.text
        return "ok" if r.json()["usage"]["completion_tokens"] == max_tokens else "short"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    results = asyncio.run(main())
    assert set(results) <= {"ok", "503"}, results
    assert results.count("503") >= 1 and results.count("ok") >= MAX_WAITING, results
    stats = server.aeng.engine.stats()
    assert stats["num_free_pages"] == stats["num_total_pages"] and stats["num_running"] == 0
    after = metric_samples(server)
    rej = f'jaxinfer:request_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}}'
    assert after[rej] - before.get(rej, 0.0) == results.count("503")


# ---------------------------------------------------------------------- TGI routes

def test_tgi_generate_and_stream_equal_the_engine(server):
    ids, want = in_process(server, "TGI prompt", greedy(7, logprobs=2))
    r = server.http.post("/generate", json={"inputs": "TGI prompt", "parameters": {
        "max_new_tokens": 7, "details": True, "top_n_tokens": 2, "return_full_text": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == "TGI prompt" + want.text
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 7
    assert [t["id"] for t in d["tokens"]] == want.token_ids
    assert [t["logprob"] for t in d["tokens"]] == [lp.logprob for lp in want.logprobs]
    assert [[t["id"] for t in top] for top in d["top_tokens"]] == [[i for i, _ in lp.top] for lp in want.logprobs]
    with server.http.stream("POST", "/generate_stream",
                            json={"inputs": "TGI prompt", "parameters": {"max_new_tokens": 7}}) as s:
        events = sse_events(s.iter_lines())
    assert [e["token"]["id"] for e in events] == want.token_ids
    assert [e["token"]["logprob"] for e in events] == [lp.logprob for lp in want.logprobs]
    assert events[-1]["generated_text"] == want.text
    assert events[-1]["details"]["finish_reason"] == "length"


def test_tgi_info_describes_the_engine(server):
    info = server.http.get("/info").json()
    cfg = server.aeng.engine.config
    assert info["model_id"] == MODEL_NAME
    assert info["max_concurrent_requests"] == cfg.max_num_seqs
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (cfg.max_model_len - 1, cfg.max_model_len)


# ---------------------------------------------------------------------- echo, chat logprobs

def test_echo_prepends_the_prompt(server):
    _, want = in_process(server, "Echo: ", greedy(5))
    r = server.client.completions.create(model=MODEL_NAME, prompt="Echo: ", max_tokens=5, temperature=0,
                                         echo=True, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Echo: " + want.text
    chunks = server.client.completions.create(model=MODEL_NAME, prompt="Echo: ", max_tokens=5, temperature=0,
                                              echo=True, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_logprobs_equal_the_engine(server):
    msgs = [{"role": "user", "content": "Log me"}]
    _, want = in_process(server, msgs, greedy(6, logprobs=3))
    kw = dict(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = server.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text
    assert [e.logprob for e in content] == [lp.logprob for lp in want.logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [[x for _, x in lp.top] for lp in want.logprobs]
    streamed = [e for c in server.client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


# ---------------------------------------------------------------------- metrics

def test_metrics_counters_move_by_what_was_served(server):
    before = metric_samples(server)
    ids, _ = in_process(server, "count me", greedy(9))
    after_in_process = metric_samples(server)        # the in-process run is not a served request
    r = server.client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 9
    after = metric_samples(server)
    m = f'{{model_name="{MODEL_NAME}"}}'
    ok = f'jaxinfer:request_success_total{{finish_reason="length",model_name="{MODEL_NAME}"}}'
    assert after[ok] - after_in_process[ok] == 1 and after_in_process[ok] == before[ok]
    assert after[f"jaxinfer:e2e_request_latency_seconds_count{m}"] - \
        before[f"jaxinfer:e2e_request_latency_seconds_count{m}"] == 1
    # token counters are the engine's: they count the in-process run's tokens as well
    assert after[f"jaxinfer:generation_tokens_total{m}"] - before[f"jaxinfer:generation_tokens_total{m}"] == 18
    assert after[f"jaxinfer:prompt_tokens_total{m}"] - before[f"jaxinfer:prompt_tokens_total{m}"] == 2 * len(ids)
    assert after[f"jaxinfer:num_requests_running{m}"] == 0


# ---------------------------------------------------------------------- SIGTERM

@contextlib.contextmanager
def server_process(default_gguf_path, *options: str):
    """tests/tiny_server.py in a process of its own, ready; ``options``: its flags (default:
    a 20 s shutdown timeout and STEP_DELAY per step) -> (process, base URL)."""
    options = options or ("--shutdown-timeout", "20", "--step-delay", str(STEP_DELAY))
    port = free_port()
    cmd = [sys.executable, os.path.join(REPO, "tests", "tiny_server.py"), "--port", str(port), *options,
           "--compile-cache", jax.config.jax_compilation_cache_dir or ""]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(url + "/health", timeout=1).json().get("status") == "ready"
        except (httpx.HTTPError, ValueError):
            return proc.poll() is not None

    try:
        assert wait_for(ready, timeout=120) and proc.poll() is None, proc.communicate()[0]
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


STEP_DELAY = 0.02     # s per engine step in the server process: 96 tokens take ~2 s


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_exits_0(default_gguf_path):
    """Three streams and a plain request in flight when SIGTERM comes: all finish with every
    token (most of them generated after the signal), a new connection is refused, exit 0."""
    n_tokens = 96
    body = {"prompt": "bye", "max_tokens": n_tokens, "stream": True, "ignore_eos": True, "temperature": 0}

    async def stream(c, started: asyncio.Event):
        async with c.stream("POST", "/v1/completions", json=body) as r:
            got = []
            async for line in r.aiter_lines():
                got.append((time.monotonic(), line))
                if line.startswith("data: "):
                    started.set()
            return got

    async def main(proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(stream(c, s)) for s in started]
            plain = asyncio.create_task(c.post("/v1/completions", json={**body, "stream": False}))
            for s in started:
                await s.wait()
            proc.send_signal(signal.SIGTERM)
            t_signal[0] = time.monotonic()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=5) as fresh:
                with pytest.raises(httpx.TransportError):   # the listener is closed
                    await fresh.post(url + "/v1/completions", json=body)
            return await asyncio.gather(*tasks), await plain

    t_signal = [0.0]
    with server_process(default_gguf_path) as (proc, url):
        streams, plain = asyncio.run(main(proc, url))
        for got in streams:
            events = sse_events([line for _, line in got])
            after = [line for t, line in got if t > t_signal[0] and line.startswith("data: {")]
            assert len(after) > n_tokens // 2, f"only {len(after)} chunks after SIGTERM: not in flight"
            assert events[-1] == "[DONE]"
            chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == n_tokens
        assert proc.wait(timeout=30) == 0

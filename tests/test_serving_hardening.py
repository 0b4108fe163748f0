"""The server under a hostile probe (issue #24): non-JSON POSTs get 415, a foreign Host 400,
a half-sent request 408 and a closed connection within the read timeout, CORS only for
origins allowed, the API key from a file or the environment, /health without internals,
and the abort counter counts clients that left before their first output.

The real AsyncEngine on a tiny random 2-layer model (the default model's tokenizer, a small
bucket ladder) serves behind the guarded uvicorn protocol, as ``jaxinfer serve`` runs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import MockAsyncEngine, serve_in_thread  # noqa: E402
from tiny_server import tiny_async_engine  # noqa: E402

from serving.app import build_app  # noqa: E402
from serving.guard import guarded_h11_protocol, host_name  # noqa: E402

READ_TIMEOUT = 1.0
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine()
    app = build_app(aeng, allowed_hosts=("localhost", "127.0.0.1", "::1"), read_timeout_s=READ_TIMEOUT)
    with serve_in_thread(app, http=guarded_h11_protocol(READ_TIMEOUT)) as url:
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, timeout=30) as http:
            yield SimpleNamespace(url=url, port=port, app=app, aeng=aeng, http=http)
    assert app.state.jx.internal_errors == 0


def _body(**kw):
    return {"model": "tiny-random-llama", "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **kw}


# ---------------------------------------------------------------------- content type

def test_post_must_be_json(server):
    raw = json.dumps(_body()).encode()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        r = server.http.post(CMPL, content=raw, headers=headers)
        assert r.status_code == 415, (ctype, r.text)
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
        r = server.http.post("/generate", content=json.dumps({"inputs": "hi"}).encode(), headers=headers)
        assert r.status_code == 415 and set(r.json()) == {"error", "error_type"}   # TGI's shape
    r = server.http.post(CMPL, content=raw, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------------- Host allow-list

def test_host_names_parse():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("example.com.") == "example.com"


def test_foreign_host_gets_400(server):
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.nip.io"):
        r = server.http.get("/health", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        r = server.http.post(CMPL, json=_body(), headers={"host": host})
        assert r.status_code == 400
        r = server.http.post("/generate", json={"inputs": "hi"}, headers={"host": host})
        assert r.status_code == 400 and set(r.json()) == {"error", "error_type"}
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert server.http.get("/health", headers={"host": host}).status_code == 200, host


# ---------------------------------------------------------------------- CORS

def test_cors_only_for_allowed_origins(server):
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}

    async def probe(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            pre = await c.options(CMPL, headers=preflight)
            get = await c.get("/v1/models", headers={"origin": "https://app.example"})
            return pre, get

    # No --allowed-origins: no CORS headers, so a browser keeps other origins' pages out.
    pre, get = asyncio.run(probe(build_app(server.aeng, shutdown_engine=False)))
    assert "access-control-allow-origin" not in pre.headers
    assert "access-control-allow-origin" not in get.headers
    app = build_app(server.aeng, shutdown_engine=False, allowed_origins=["https://app.example"])
    pre, get = asyncio.run(probe(app))
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert get.headers["access-control-allow-origin"] == "https://app.example"
    evil = dict(preflight, origin="https://evil.example")

    async def probe_evil():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await c.options(CMPL, headers=evil)

    r = asyncio.run(probe_evil())
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


# ---------------------------------------------------------------------- read timeouts

def _raw_exchange(port: int, data: bytes, limit: float) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes -> (everything read, seconds until closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        t0 = time.monotonic()
        s.sendall(data)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                pytest.fail(f"connection still open after {limit} s; read so far: {got!r}")
            if not chunk:
                return got, time.monotonic() - t0
            got += chunk


def test_headers_never_finished_get_408_and_close(server):
    got, secs = _raw_exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                              READ_TIMEOUT + 5)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert READ_TIMEOUT * 0.9 <= secs <= READ_TIMEOUT + 2
    got, secs = _raw_exchange(server.port, b"", READ_TIMEOUT + 5)    # connected, sent nothing
    assert got.startswith(b"HTTP/1.1 408") and secs <= READ_TIMEOUT + 2


def test_body_shorter_than_content_length_gets_408_and_close(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    got, secs = _raw_exchange(server.port, head + b'{"prompt": "hel', READ_TIMEOUT + 5)
    assert got.startswith(b"HTTP/1.1 408"), got
    body = json.loads(got.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_timeout"             # the API's error shape
    assert READ_TIMEOUT * 0.9 <= secs <= READ_TIMEOUT + 2
    # A route that never reads the body: answered, then closed by the protocol's backstop.
    got, secs = _raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                           b"Content-Length: 50\r\n\r\nabc", READ_TIMEOUT + 5)
    assert got.startswith(b"HTTP/1.1 200") and secs <= READ_TIMEOUT + 3
    # A keep-alive connection whose second request stalls is timed out too.
    req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    got, secs = _raw_exchange(server.port, req + b"GET /health HTTP/1.1\r\nHo", READ_TIMEOUT + 5)
    assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got and secs <= READ_TIMEOUT + 2
    assert server.http.post(CMPL, json=_body()).status_code == 200   # the server is fine


# ---------------------------------------------------------------------- /health and metrics

def test_health_failed_says_no_internals():
    def broken():
        raise RuntimeError("cannot open /home/alice/secret-models/model.gguf")

    app = build_app(engine_factory=broken)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        deadline = time.monotonic() + 10
        while (r := c.get("/health")).json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        r = c.post(CMPL, json=_body())
        assert r.status_code == 503 and "secret" not in r.text
    assert "secret-models" in app.state.jx.load_error      # kept for the log


def test_abort_counter_counts_clients_gone_before_first_output():
    engine = MockAsyncEngine()
    engine.paused = True           # nothing is scheduled: no request gets a first output
    app = build_app(engine)
    with serve_in_thread(app) as url:
        async def drop_all(n: int) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=0.3) as c:
                async def one(i: int) -> None:
                    with pytest.raises(httpx.TimeoutException):
                        await c.post(CMPL, json=_body(model="mock-model", stream=i % 2 == 1))
                await asyncio.gather(*(one(i) for i in range(n)))

        asyncio.run(drop_all(20))
        deadline = time.monotonic() + 10
        while len(engine.aborted) < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        text = httpx.get(url + "/metrics").text
    line = next(x for x in text.splitlines()
                if x.startswith("jaxinfer:request_success_total") and 'finish_reason="abort"' in x)
    assert float(line.rsplit(" ", 1)[1]) == 20, line
    assert len(engine.aborted) == 20


# ---------------------------------------------------------------------- API key from file / env

def _serve_args(argv: list[str], monkeypatch, env: dict[str, str] | None = None):
    """Run ``jaxinfer serve argv`` up to the server -> the api_key it would serve with."""
    import serving.server
    from serving import cli

    seen = {}
    monkeypatch.setattr(serving.server, "serve_main", lambda args: (seen.__setitem__("key", args.api_key), 0)[1])
    monkeypatch.delenv("JAXINFER_API_KEY", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = cli.main(["serve", *argv])
    return rc, seen.get("key")


def test_api_key_from_file_and_env(tmp_path, monkeypatch, capsys):
    f = tmp_path / "key"
    f.write_text("s3cret-from-file\n")
    f.chmod(0o600)
    assert _serve_args(["--api-key-file", str(f)], monkeypatch) == (0, "s3cret-from-file")
    assert _serve_args([], monkeypatch, {"JAXINFER_API_KEY": "s3cret-env"}) == (0, "s3cret-env")
    # the command line wins over the environment; nothing set: no key
    assert _serve_args(["--api-key", "flag"], monkeypatch, {"JAXINFER_API_KEY": "env"}) == (0, "flag")
    assert _serve_args(["--api-key-file", str(f)], monkeypatch, {"JAXINFER_API_KEY": "env"})[1] \
        == "s3cret-from-file"
    assert _serve_args([], monkeypatch) == (0, None)
    capsys.readouterr()
    assert _serve_args(["--api-key", "a", "--api-key-file", str(f)], monkeypatch)[0] == 2
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert _serve_args(["--api-key-file", str(empty)], monkeypatch)[0] == 2
    assert _serve_args(["--api-key-file", str(tmp_path / "missing")], monkeypatch)[0] == 2
    err = capsys.readouterr().err
    assert "give one of them" in err and "first line is empty" in err and "missing" in err


def test_api_key_from_file_guards_the_server(server, tmp_path, monkeypatch):
    f = tmp_path / "key"
    f.write_text("k3y\n")
    _, key = _serve_args(["--api-key-file", str(f)], monkeypatch)
    app = build_app(server.aeng, shutdown_engine=False, api_key=key)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            bad = await c.get("/v1/models")
            good = await c.get("/v1/models", headers={"authorization": "Bearer k3y"})
            return bad.status_code, good.status_code

    assert asyncio.run(go()) == (401, 200)


# ---------------------------------------------------------------------- AsyncEngine

@contextlib.contextmanager
def _engine_paused(aeng):
    """Hold the AsyncEngine's lock while it idles: its loop cannot step, so this thread may
    drive the engine directly (and must leave nothing unfinished)."""
    with aeng._wake:
        assert not aeng._inbox and not aeng.engine.has_unfinished()
        yield aeng.engine
        assert not aeng.engine.has_unfinished()


def _run(engine, prompts, params, deltas):
    ids = [engine.add_request(p, params, request_id=f"{'d' if deltas else 'c'}{i}") for i, p in enumerate(prompts)]
    final, parts = {}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step(deltas=deltas):
            parts[out.request_id].append(out)
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids], [parts[i] for i in ids]


def test_deltas_join_to_the_cumulative_outputs(server):
    from jaxinfer.sampling_params import SamplingParams

    prompts = ["Hello there", "The quick brown fox", [5, 6, 7, 8, 9]]
    p = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2, stop=["e t"])
    with _engine_paused(server.aeng) as engine:
        want, _ = _run(engine, prompts, p, deltas=False)
        got, parts = _run(engine, prompts, p, deltas=True)
    for w, steps in zip(want, parts):
        for i, wo in enumerate(w.outputs):
            pieces = [s.outputs[i] for s in steps]
            assert "".join(o.text for o in pieces) == wo.text
            assert [t for o in pieces for t in o.token_ids] == wo.token_ids
            assert [lp for o in pieces for lp in o.logprobs] == wo.logprobs
            assert pieces[-1].finish_reason == wo.finish_reason and pieces[-1].stop_reason == wo.stop_reason
        assert max(len(s.outputs[0].token_ids) for s in steps) <= 1      # only what is new


def test_add_and_abort_never_wait_for_a_step(server, monkeypatch):
    """While a step is in flight (held open until the test releases it), an abort and a
    new request both reach the engine's inbox: neither waits for the step."""
    from jaxinfer.sampling_params import SamplingParams

    aeng, engine = server.aeng, server.aeng.engine
    real_step = engine.step
    in_step, release = threading.Event(), threading.Event()

    def held_step(*a, **kw):
        in_step.set()
        release.wait(60)
        return real_step(*a, **kw)

    monkeypatch.setattr(engine, "step", held_step)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def posted(cmd: tuple) -> bool:
        return any(c[:len(cmd)] == cmd for c in aeng._inbox)

    async def until(cond, what: str) -> None:
        for _ in range(3000):                  # 30 s: generous, only a wait for the step fails
            if cond():
                return
            await asyncio.sleep(0.01)
        pytest.fail(f"{what} did not reach the engine while its step was held")

    async def main():
        a = aeng.generate([1, 2, 3, 4], p, "slow-a")
        first = asyncio.ensure_future(a.__anext__())
        await asyncio.to_thread(in_step.wait, 10)        # a's step is now in flight (held)
        await aeng.abort("slow-a")
        b = aeng.generate([1, 2, 3, 4, 5], p, "slow-b")
        b_first = asyncio.ensure_future(b.__anext__())
        await until(lambda: posted(("abort", "slow-a")), "the abort")
        await until(lambda: posted(("add", "slow-b")), "the add")
        assert not release.is_set()
        release.set()
        out = await b_first
        async for out in b:
            pass
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await a.aclose()
        return out

    try:
        out = asyncio.run(main())
    finally:
        release.set()
    assert out.finished and len(out.outputs[0].token_ids) == 3
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    st = engine.stats()
    assert st["num_free_pages"] == st["num_total_pages"]            # the aborted request freed its pages


def test_tokenization_runs_off_the_event_loop(server, monkeypatch):
    from jaxinfer.sampling_params import SamplingParams

    aeng = server.aeng
    threads = []
    real = aeng.engine.encode_prompt

    def encode(prompt):     # token ids are only validated (also by add_request): not counted
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            threads.append(threading.get_ident())
        return real(prompt)

    monkeypatch.setattr(aeng.engine, "encode_prompt", encode)

    async def main():
        loop_thread = threading.get_ident()
        p = SamplingParams(temperature=0, max_tokens=2)
        for prompt in ("Hello there", [{"role": "user", "content": "Hi"}]):
            async for out in aeng.generate(prompt, p, f"tok-{len(threads)}"):
                pass
            assert out.finished and out.prompt_token_ids
        with pytest.raises(ValueError, match="prompt"):       # bad input: raised before any output
            async for out in aeng.generate("", p, "tok-empty"):
                pass
        return loop_thread

    loop_thread = asyncio.run(main())
    assert len(threads) == 3 and loop_thread not in threads and aeng._thread.ident not in threads

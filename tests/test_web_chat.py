"""The chat page at / in a real browser: Debian's Chromium driven by Playwright, against a
real server (uvicorn + AsyncEngine) on a tiny random-weight Llama.

It sends messages and watches the reply grow as tokens stream in (and equal the server's
own non-streamed greedy answer for the same conversation), stops a long reply and checks
/metrics shows its KV pages freed, and uses the page with the API key on. A failing test
leaves a screenshot in $JAXINFER_TEST_ARTIFACTS (default: the temp dir) under
jaxinfer-web-failures/. JAXINFER_UPDATE_SCREENSHOT=1 serves the default model instead and
refreshes serving/web/screenshot.png (the README's picture) from the first test.

Skips only when no Chromium is installed (`apt-get install chromium`; .ci/run does it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from test_engine import tiny_loaded  # noqa: E402

BROWSER = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium): "
                                                         "the chat page's browser test cannot run")]
from playwright import sync_api

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAILURES = pathlib.Path(os.environ.get("JAXINFER_TEST_ARTIFACTS", tempfile.gettempdir())) / "jaxinfer-web-failures"
# One compiled shape per step kind: 4 decode rows, 4 prefill slots of 16, 32 pages a sequence.
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, num_pages=48,
                 page_buckets=(32,), min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4),
                 prefill_buckets=((4, 16),))
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(default_gguf_path):
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer
    from serving.app import build_app

    if os.environ.get("JAXINFER_UPDATE_SCREENSHOT"):
        # The README's picture: the default model, whose replies are words, not noise.
        from jaxinfer.loading import load_model

        loaded = load_model(None)
    else:
        loaded = tiny_loaded(Tokenizer.from_gguf_reader(open_gguf(default_gguf_path)))  # no tensor read
    engine = Engine(loaded=loaded, progress=False, **ENGINE_KW)
    aeng = AsyncEngine(engine)
    app = build_app(aeng)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, app=app, model=engine.model_name)
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=BROWSER, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    # bypass_csp: Playwright evaluates its wait conditions as strings, which the page's CSP
    # forbids (test_page_and_assets_are_served_offline checks the header itself).
    ctx = browser.new_context(viewport={"width": 1100, "height": 700}, bypass_csp=True)
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    yield pg
    ctx.close()


@contextlib.contextmanager
def slow_steps(engine, seconds: float):
    """Make each engine step last at least ``seconds`` (a real model's pace on CPU), so a
    long reply is still streaming when the test presses Stop."""
    step = engine.step

    def slow(*args, **kwargs):          # AsyncEngine calls step(deltas=True)
        t = time.monotonic()
        out = step(*args, **kwargs)
        time.sleep(max(0.0, seconds - (time.monotonic() - t)))
        return out

    engine.step = slow
    try:
        yield
    finally:
        del engine.step       # the class's method again


@contextlib.contextmanager
def shot_on_failure(pg, request):
    """Screenshot the page when the test body raises (the fixture sees failures too late)."""
    try:
        yield
    except BaseException:
        FAILURES.mkdir(parents=True, exist_ok=True)
        path = FAILURES / f"{request.node.name}.png"
        pg.screenshot(path=str(path), full_page=True)
        print(f"screenshot of the failing page: {path}", file=sys.stderr)
        raise


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value}; a labelled sample also as "name{label=value}"."""
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name] = s.value
            for k, v in s.labels.items():
                if k != "model_name":
                    out[f"{s.name}{{{k}={v}}}"] = s.value
    return out


def record_reply_lengths(pg) -> None:
    """In the page: note the length of the newest reply's text each time it changes."""
    pg.evaluate("""() => {
        window.__lens = [];
        new MutationObserver(() => {
            const t = [...document.querySelectorAll('.msg.assistant .text')].pop();
            if (t) window.__lens.push(t.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")


def send(pg, text: str) -> None:
    pg.fill("#prompt", text)
    pg.click("#send")


def wait_reply_done(pg, n: int) -> str:
    """Wait for the n-th reply (1-based) to finish; return its text."""
    pg.wait_for_function(f"document.querySelectorAll('.msg.assistant').length >= {n} && "
                         "!document.querySelector('.msg.streaming')")
    return pg.locator(".msg.assistant .text").nth(n - 1).inner_text()


def greedy(url: str, model: str, messages: list[dict], max_tokens: int, headers=None) -> tuple[str, int]:
    """The server's own non-streamed greedy reply: (text, completion tokens)."""
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers=headers,
                   json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]


def greedy_reply(url: str, model: str, messages: list[dict], max_tokens: int, headers=None) -> str:
    return greedy(url, model, messages, max_tokens, headers)[0]


def set_options(pg, *, system: str = "", temperature: str = "0", max_tokens: str = "24") -> None:
    pg.fill("#system", system)
    pg.fill("#temperature", temperature)
    pg.fill("#max-tokens", max_tokens)


def test_chat_streams_replies_and_keeps_the_conversation(server, page, request):
    with shot_on_failure(page, request):
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        assert page.locator("#model").input_value() == server.model
        set_options(page, system="You are terse.")
        record_reply_lengths(page)
        send(page, "Hello there")
        first = wait_reply_done(page, 1)
        lens = page.evaluate("window.__lens")
        # the reply grew over several updates: tokens were rendered as they arrived
        assert len({x for x in lens if 0 < x < len(first)}) >= 3, lens
        system = {"role": "system", "content": "You are terse."}
        msgs = [system, {"role": "user", "content": "Hello there"}]
        want, ntok = greedy(server.url, server.model, msgs, 24)
        assert first == want
        stats = page.locator(".msg.assistant .stats").first.inner_text()
        assert "TTFT" in stats and "tokens/s" in stats and f"{ntok} tokens" in stats, stats

        send(page, "And then?")        # the second turn carries the first
        second = wait_reply_done(page, 2)
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
        assert second == greedy_reply(server.url, server.model, msgs, 24)
        assert page.locator(".msg.user").count() == 2
        if os.environ.get("JAXINFER_UPDATE_SCREENSHOT"):
            page.screenshot(path=str(ROOT / "serving" / "web" / "screenshot.png"))


def test_stop_cancels_the_request_and_frees_its_pages(server, page, request):
    with shot_on_failure(page, request), slow_steps(server.engine, 0.02):
        total = server.engine.stats()["num_total_pages"]
        aborted = "jaxinfer:request_success_total{finish_reason=abort}"
        aborts_before = metrics(server.url).get(aborted, 0.0)
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        max_tokens = 440
        set_options(page, max_tokens=str(max_tokens))
        send(page, "Tell me a very long story about a lighthouse.")
        page.wait_for_function("(document.querySelector('.msg.assistant .text') || {}).textContent?.length > 8")
        page.click("#stop")
        page.wait_for_function("!document.querySelector('.msg.streaming')")
        stats = page.locator(".msg.assistant .stats").first.inner_text()
        assert "stopped" in stats and f"{max_tokens} tokens" not in stats, stats
        # The server noticed the closed connection: the request ended as an abort and its
        # KV pages went back to the pool.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metrics(server.url)
            if m.get(aborted, 0.0) > aborts_before and m["jaxinfer:kv_cache_usage_perc"] == 0:
                break
            time.sleep(0.05)
        assert m.get(aborted, 0.0) == aborts_before + 1, m
        assert m["jaxinfer:kv_cache_usage_perc"] == 0.0, m
        assert m["jaxinfer:num_requests_running"] == 0.0
        assert m["jaxinfer:kv_cache_free_pages"] == total
        assert not page.locator("#stop").is_enabled() and page.locator("#send").is_enabled()


def test_page_asks_for_the_api_key(server, page, request):
    st = server.app.state.jx
    st.api_key = "s3cret"
    try:
        with shot_on_failure(page, request):
            page.goto(server.url + "/")              # the page itself needs no key
            page.wait_for_selector("#key-box:not([hidden])")
            assert "API key" in page.locator("#status").inner_text()
            assert page.locator("#model option").count() == 0 and not page.locator("#send").is_enabled()
            page.fill("#api-key", "wrong")
            page.click("#key-save")
            page.wait_for_function("document.querySelector('#status').textContent.includes('invalid API key')")
            page.fill("#api-key", "s3cret")
            page.click("#key-save")
            page.wait_for_function("document.querySelector('#model').options.length > 0")
            set_options(page, max_tokens="6")
            send(page, "Hi")
            reply = wait_reply_done(page, 1)
            auth = {"Authorization": "Bearer s3cret"}
            assert reply == greedy_reply(server.url, server.model, [{"role": "user", "content": "Hi"}], 6, auth)
    finally:
        st.api_key = None


def test_page_and_assets_are_served_offline(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert "http://" not in r.text and "https://" not in r.text     # no CDN, nothing remote
    for asset, ctype in (("chat.js", "javascript"), ("chat.css", "text/css")):
        a = httpx.get(f"{server.url}/static/{asset}")
        assert a.status_code == 200 and ctype in a.headers["content-type"]
        assert "http://" not in a.text and "https://" not in a.text
    assert httpx.get(server.url + "/static/nope.js").status_code == 404

"""Grammar compilation never stalls the engine (issue #51): while a chat request with 64
fresh tools and ``tool_choice: "required"`` compiles its grammar, 20 plain completions sent
alongside finish at their normal speed; a compile over the time budget is a 400 naming it.

The real AsyncEngine on the tiny random model of tests/tiny_server.py (the default model's
tokenizer, 49,152 tokens, as llguidance sees it in production) behind the real server. A
grammar of 64 tools compiles in tens of milliseconds here, too fast to see whether it
blocks anything; so the library's compile is held open (``_Gate``, after the real compile
of the 64-tool grammar, as a grammar that takes long to build would): the plain
completions must all finish while it is held. Compiled on the engine thread, they would
wait for it.

The chat template reads ``tools`` (as Qwen's does) but only says how many there are: the
SmolLM2 template would list all 64 in a system message (~3,500 tokens, beyond the tiny
model's context); the grammar covers all 64 either way."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from jaxinfer.engine import guided as G  # noqa: E402
from serving.app import build_app  # noqa: E402

TEMPLATE = ("{% if tools %}<|im_start|>system\nYou can call {{ tools | length }} tools.<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
PLAIN_TIMEOUT_S = 30.0      # a plain completion that waits this long is stalled (baseline: well under 1 s)


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine()
    aeng.tokenizer.hf.chat_template = TEMPLATE
    # The first compile builds llguidance's view of the tokenizer (~1 s, holding the GIL),
    # once per engine: done here, so each test measures a compile, not that.
    aeng.engine.grammars.compile(G.GuidedDecoding.parse({"regex": "[0-9]"}))
    app = build_app(aeng)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, aeng=aeng, app=app)
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


class _Gate:
    """Holds every grammar compile open, after the library's real work, until ``open()``."""

    def __init__(self, monkeypatch):
        self.started, self.finished, self._open = threading.Event(), threading.Event(), threading.Event()
        build = G.GrammarCompiler._build

        def held(compiler, spec):
            self.started.set()
            try:
                out = build(compiler, spec)
                self._open.wait(120)
                return out
            finally:
                self.finished.set()
        monkeypatch.setattr(G.GrammarCompiler, "_build", held)

    def open(self) -> None:
        self._open.set()


def _fresh_tools(n: int) -> list[dict]:
    """``n`` tools whose names no earlier request used (so nothing comes from the cache)."""
    tag = uuid.uuid4().hex[:8]
    return [{"type": "function", "function": {"name": f"fn_{tag}_{i}", "description": f"tool {i}",
                                              "parameters": UNIT}} for i in range(n)]


def _tools_request(url: str, tools: list[dict]) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools, "tool_choice": "required", "max_tokens": 64, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _plain(url: str) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True}, timeout=PLAIN_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def _plain_batch(url: str, n: int) -> list[float]:
    """Latencies of ``n`` plain completions sent at once."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _plain(url), range(n)))


def _check_call(r: httpx.Response, tools: list[dict]) -> None:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call, = choice["message"]["tool_calls"]
    assert call["function"]["name"] in {t["function"]["name"] for t in tools}
    assert json.loads(call["function"]["arguments"]) in ({"unit": "c"}, {"unit": "f"})


def test_plain_completions_keep_their_speed_while_64_tools_compile(server, monkeypatch):
    _plain(server.url)                              # warm: the first request's one-off costs
    base = max(_plain_batch(server.url, 20))
    monkeypatch.setattr(server.aeng.engine.grammars, "time_budget", 300.0)
    gate, tools = _Gate(monkeypatch), _fresh_tools(64)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_tools_request, server.url, tools)
        try:
            assert gate.started.wait(30), "the tools request's grammar never started compiling"
            during = _plain_batch(server.url, 20)
            # all 20 finished while the grammar was still compiling (held open)
            assert not gate.finished.is_set()
        finally:
            gate.open()
        _check_call(pending.result(120), tools)
    assert max(during) <= max(2 * base, base + 1.0), (during, base)


def test_a_compile_over_the_time_budget_is_a_400_naming_it(server, monkeypatch):
    monkeypatch.setattr(server.aeng.engine.grammars, "time_budget", 0.5)
    gate, tools = _Gate(monkeypatch), _fresh_tools(64)
    try:
        r = _tools_request(server.url, tools)
        assert r.status_code == 400, r.text
        assert "did not compile within the time budget of 0.5 s" in r.json()["error"]["message"]
        assert not gate.finished.is_set()           # still compiling; the engine serves meanwhile
        _plain(server.url)
    finally:
        gate.open()
    assert gate.finished.wait(30)
    # the compile that outlived its caller landed in the cache: the same tools now pass at once
    _check_call(_tools_request(server.url, tools), tools)

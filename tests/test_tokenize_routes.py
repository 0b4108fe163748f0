"""/tokenize and /detokenize (serving/tokenize_routes.py) against the REAL engine's
tokenizer (the tiny model of tests/tiny_server.py): vLLM's shapes, counts equal to what the
generation routes bill (``usage.prompt_tokens``), round trips, and hostile bodies answered
4xx in OpenAI's error shape naming the field."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from serving.app import build_app  # noqa: E402
from serving.errors import ProtocolError  # noqa: E402
from serving.tokenize_routes import MAX_DETOKENIZE_TOKENS, detokenize  # noqa: E402

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour, héllo 👋"}]
TOOLS = [{"type": "function", "function": {"name": "paint", "description": "paint a wall",
                                           "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def http():
    aeng = tiny_async_engine()
    app = build_app(aeng, max_body_bytes=64 * 1024)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.aeng, client.app_state = aeng, app.state.jx
        yield client
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


def test_prompt_round_trip_and_count_equals_completions_usage(http):
    text = "The quick brown fox, naïve café 日本語 ✓"
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == http.aeng.max_model_len
    usage = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": plain})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(isinstance(s, str) for s in strs["token_strs"])


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_count_equals_chat_completions_usage(http, tools):
    extra = {} if tools is None else {"tools": tools}
    r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": CHAT, **extra})
    assert r.status_code == 200, r.text
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1, **extra})
    if tools is None:
        billed = chat.json()["usage"]["prompt_tokens"]
    else:       # the tools' system prompt alone outgrows the tiny model's 128 tokens: the route says how long
        err = chat.json()["error"]
        assert err["code"] == "context_length_exceeded", err
        billed = int(re.search(r"the prompt is (\d+) tokens", err["message"]).group(1))
    assert r.json()["count"] == billed
    no_gen = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    if tools is None:                  # the generation prompt is tokens of its own
        assert no_gen["count"] < r.json()["count"]
        assert r.json()["tokens"][:no_gen["count"]] == no_gen["tokens"]


def test_detokenize_empty_and_special_tokens(http):
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    eos = http.aeng.tokenizer.eos_token_ids[0]
    text = http.post("/detokenize", json={"tokens": [eos]}).json()["prompt"]
    assert text and text == http.aeng.tokenizer.decode([eos], skip_special_tokens=False)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other-model"}, "model"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "tools": "paint"}, "tools"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**12]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": 5}, "model"),
])
def test_hostile_bodies_get_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_size_bounds_and_not_json(http):
    limits = http.app_state.limits(http.aeng)
    with pytest.raises(ProtocolError) as e:             # under a larger body limit than this server's
        detokenize({"tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)}, limits, http.aeng.tokenizer)
    assert e.value.param == "tokens" and e.value.status == 400
    assert http.post("/tokenize", json={"prompt": "x" * 100_000}).status_code == 413
    r = http.post("/tokenize", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "error" in r.json()
    assert http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert http.get("/tokenize").status_code == 405

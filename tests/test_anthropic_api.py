"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against the
REAL tiny engine, driven by the official ``anthropic`` client: plain and streamed messages
(the event order checked against Anthropic's documented sequence), a two-turn tool-use
loop, stop sequences, token counting, both ways of sending the API key, and hostile bodies
(4xx in Anthropic's error shape, never a 500). Greedy replies equal /v1/chat/completions'
for the same conversation, as the official ``openai`` client gets them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from tiny_server import tiny_async_engine  # noqa: E402

from jaxinfer.outputs import CompletionOutput, RequestOutput  # noqa: E402
from serving import anthropic_request as AR  # noqa: E402
from serving.anthropic_response import AnthropicStream  # noqa: E402
from serving.app import build_app  # noqa: E402
from serving.openai_request import parse_chat_request  # noqa: E402
from serving.dialect import Answering  # noqa: E402
from serving.request import GenRequest  # noqa: E402
from serving.tools import ToolSpec  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

KEY = "sekrit-key"
# Room for the tools' system prompt (~170 tokens): the tiny model's whole 256-token context.
ENGINE_KW = dict(max_model_len=256, num_pages=64, page_buckets=(16,))
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Anthropic's documented stream: message_start, then content blocks (start, deltas, stop),
# message_delta, message_stop; ping may come anywhere after message_start.
_ORDER = re.compile(r"S(?:B(?:D)*E)+M Z")


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine(**ENGINE_KW)
    # a body limit above the text-block bound, so that bound (not the 413) is what answers
    app = build_app(aeng, api_key=KEY, max_body_bytes=4 << 20)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120,
                                                    headers={"x-api-key": KEY}) as http:
        names = app.state.jx.model_names()
        yield SimpleNamespace(url=url, app=app, http=http, model=names[0], context=aeng.max_model_len,
                              client=anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120),
                              oai=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


# This client version has no sampling arguments (temperature, top_p, top_k): they go as
# extra body fields, which the Messages API still defines.
GREEDY = {"extra_body": {"temperature": 0}}


def _create(server, **kw):
    return server.client.messages.create(model=server.model, **GREEDY, **kw)


def _chat(server, messages, **kw):
    return server.oai.chat.completions.create(model=server.model, messages=messages, temperature=0, **kw)


def _same_prompt(server, anthropic_body: dict, openai_body: dict) -> None:
    """Both parsers build the same prompt token ids (token counts alone can agree by chance:
    "user" and "tool" are one token each)."""
    st = server.app.state.jx
    lim, tok = st.limits(st.engine), st.engine.tokenizer
    a = AR.parse_messages_request({"model": server.model, "max_tokens": 4, **anthropic_body}, lim, tok)
    o = parse_chat_request({"model": server.model, "max_tokens": 4, **openai_body}, lim, tok)
    assert a.prompt_ids == o.prompt_ids


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def _sse(server, body: dict) -> list[tuple[str, dict]]:
    """The raw stream: (event line, data) pairs; every data names its event as its type."""
    events, name = [], None
    with server.http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert name == data["type"], (name, data)
                events.append((name, data))
                name = None
    return events


def _check_order(events: list[tuple[str, dict]]) -> None:
    code = {"message_start": "S", "content_block_start": "B", "content_block_delta": "D",
            "content_block_stop": "E", "message_delta": "M", "message_stop": "Z"}
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start"
    seq = "".join(code[k] for k in kinds if k != "ping")
    assert _ORDER.fullmatch(seq.replace("MZ", "M Z")), kinds
    open_index = -1
    for k, d in events:          # block indices count up from 0, each delta inside its block
        if k == "content_block_start":
            assert d["index"] == open_index + 1
            open_index = d["index"]
        elif k in ("content_block_delta", "content_block_stop"):
            assert d["index"] == open_index


# ------------------------------------------------------------------ messages


def test_plain_message_equals_chat_completions(server):
    convo = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
             {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story."}]}]
    m = _create(server, max_tokens=12, system=[{"type": "text", "text": SYSTEM}], messages=convo,
                metadata={"user_id": "u-1"}, extra_headers={"anthropic-version": "2023-06-01"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == server.model
    oai_convo = [{"role": "system", "content": SYSTEM}, *convo[:2],
                 {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story."}]}]
    c = _chat(server, oai_convo, max_tokens=12)
    _same_prompt(server, {"system": [{"type": "text", "text": SYSTEM}], "messages": convo}, {"messages": oai_convo})
    assert _text(m) == c.choices[0].message.content
    assert m.usage.input_tokens == c.usage.prompt_tokens and m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert m.stop_sequence is None


def test_stream_equals_non_stream_in_the_documented_order(server):
    body = dict(max_tokens=16, system=SYSTEM, messages=ASK)
    m = _create(server, **body)
    with server.client.messages.stream(model=server.model, **GREEDY, **body) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == _text(m) == _text(final)
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    raw = _sse(server, {"model": server.model, "temperature": 0, **body})
    _check_order(raw)
    assert "ping" in [k for k, _ in raw]
    assert "".join(d["delta"]["text"] for k, d in raw if k == "content_block_delta") == _text(m)
    start, delta = raw[0][1]["message"], [d for k, d in raw if k == "message_delta"][0]
    assert start["usage"]["input_tokens"] == m.usage.input_tokens and start["content"] == []
    assert delta["delta"]["stop_reason"] == m.stop_reason and delta["usage"]["output_tokens"] == m.usage.output_tokens
    # the client's raw events parse in the same order (how many deltas depends on timing)
    events = list(server.client.messages.create(model=server.model, **GREEDY, stream=True, **body))
    assert _runs([e.type for e in events]) == _runs([k for k, _ in raw if k != "ping"])
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(m)


def _runs(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


def test_stop_sequences(server):
    base = _text(_create(server, max_tokens=24, messages=ASK))
    stop = base[6:9]
    assert stop and len(base) > 9, base
    m = _create(server, max_tokens=24, messages=ASK, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert _text(m) == base[:base.index(stop)]
    with server.client.messages.stream(model=server.model, **GREEDY, max_tokens=24, messages=ASK,
                                       stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == (m.stop_reason, stop, _text(m))


def test_count_tokens_is_the_prompt_length(server):
    n = server.client.messages.count_tokens(model=server.model, system=SYSTEM, messages=ASK,
                                            tools=[WEATHER]).input_tokens
    m = _create(server, max_tokens=2, system=SYSTEM, messages=ASK, tools=[WEATHER])
    c = _chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=2, tools=[_oai_tool(WEATHER)])
    assert n == m.usage.input_tokens == c.usage.prompt_tokens
    assert n > server.client.messages.count_tokens(model=server.model, system=SYSTEM, messages=ASK).input_tokens


# ------------------------------------------------------------------ tools


def _oai_tool(t: dict) -> dict:
    return {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                             "parameters": t["input_schema"]}}


def test_two_turn_tool_use_loop(server):
    m = _create(server, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use", m
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER["input_schema"])
    # the same call, streamed: a tool_use block opened empty, its input as input_json_delta
    raw = _sse(server, {"model": server.model, "temperature": 0, "max_tokens": 60, "messages": ASK,
                        "tools": [WEATHER], "tool_choice": {"type": "any"}})
    _check_order(raw)
    block = [d["content_block"] for k, d in raw if k == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    assert len(block) == 1 and block[0]["name"] == "get_weather" and block[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for k, d in raw
                      if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == use[0].input
    assert [d for k, d in raw if k == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    # turn two: the tool's answer; the prompt and the greedy reply equal the chat route's
    convo = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                 "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    m2 = _create(server, max_tokens=12, messages=convo, tools=[WEATHER])
    oai = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use[0].input)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"}]
    c2 = _chat(server, oai, max_tokens=12, tools=[_oai_tool(WEATHER)])
    _same_prompt(server, {"messages": convo, "tools": [WEATHER]}, {"messages": oai, "tools": [_oai_tool(WEATHER)]})
    assert m2.usage.input_tokens == c2.usage.prompt_tokens > m.usage.input_tokens
    if c2.choices[0].message.tool_calls:
        assert m2.stop_reason == "tool_use"
    else:
        assert _text(m2) == c2.choices[0].message.content


def test_named_tool_choice_and_none(server):
    m = _create(server, max_tokens=60, messages=ASK, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    # none: the tools are not shown, as on the chat route
    n = server.client.messages.count_tokens(model=server.model, messages=ASK, tools=[WEATHER],
                                            tool_choice={"type": "none"}).input_tokens
    assert n == server.client.messages.count_tokens(model=server.model, messages=ASK).input_tokens


def _fake_out(text: str, finish: str | None, ntok: int) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(range(ntok)), finish, None)],
                         finished=finish is not None)


def test_stream_text_then_tool_call_and_failure_events():
    """Auto tool choice: text before a call streams as a text block, the call as a tool_use
    block after it; a failure is an ``error`` event (unit: the events from outputs)."""
    spec = ToolSpec(({"name": "get_weather", "description": "", "parameters": {}},), "auto")
    req = GenRequest("messages", "m", [1, 2], "", SamplingParams(), stream=True, tools=spec)
    s = AnthropicStream(req, Answering(None, frozenset()))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    chunks = [*s.events(_fake_out("Let me check. <tool", None, 3)),
              *s.events(_fake_out("Let me check. " + call, "stop", 9)), *s.end(_fake_out("Let me check. " + call, "stop", 9))]
    events = []
    for c in chunks:
        head, data = c.decode().strip().split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    _check_order(events)
    blocks = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    text = "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta")
    assert blocks == ["text", "tool_use"] and text.strip() == "Let me check."
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] == 9
    fail = b"".join(s.failure("boom", "engine_dead")).decode()
    assert fail.startswith("event: error\n") and json.loads(fail.split("data: ")[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "boom"}}


# ------------------------------------------------------------------ auth


def test_api_key_as_x_api_key_or_bearer(server):
    ok = {"model": server.model, "max_tokens": 2, "messages": ASK}
    assert httpx.post(server.url + "/v1/messages", json=ok, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert httpx.post(server.url + "/v1/messages", json=ok, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60).status_code == 200
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=server.model, max_tokens=2, messages=ASK).type == "message"
    for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}, {"x-api-key": KEY[:-1]}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(server.url + path, json=ok, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
            _assert_error_shape(r)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=server.model, max_tokens=2, messages=ASK)


# ------------------------------------------------------------------ hostile input


def _assert_error_shape(r: httpx.Response) -> str:
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str), body
    return body["error"]["message"]


def _msg(content) -> list:
    return [{"role": "user", "content": content}]


_TEXT = AR.MAX_TEXT_CHARS + 1
LONG = {"messages": _msg("hello " * 600)}
HOSTILE = [  # (body changes, the field the message names)
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2 ** 40}, "max_tokens"),
    ({"model": None}, "model"), ({"model": 3}, "model"), ({"model": "claude-nope"}, "model"),
    ({"messages": None}, "messages"), ({"messages": {}}, "messages"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}] * (AR.MAX_MESSAGES + 1)}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"), ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"), ({"messages": _msg(5)}, "messages[0].content"),
    ({"messages": _msg(["x"])}, "messages[0].content[0]"),
    ({"messages": _msg([{"type": "text"}])}, "messages[0].content[0].text"),
    ({"messages": _msg([{"type": "text", "text": 1}])}, "messages[0].content[0].text"),
    ({"messages": _msg([{"type": "video"}])}, "messages[0].content[0].type"),
    ({"messages": _msg([{"text": "no type"}])}, "messages[0].content[0].type"),
    ({"messages": _msg([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}])},
     "messages[0].content[0].type"),
    ({"messages": _msg([{"type": "text", "text": "a"}] * (AR.MAX_BLOCKS + 1))}, "messages[0].content"),
    ({"messages": _msg("x" * _TEXT)}, "messages[0].content"),
    ({"messages": _msg([{"type": "tool_use", "id": "t", "name": "f", "input": {}}])}, "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0].type"),
    ({"messages": _msg([{"type": "tool_result", "content": "x"}])}, "messages[0].content[0].tool_use_id"),
    ({"messages": _msg([{"type": "tool_result", "tool_use_id": "t" * 300}])}, "messages[0].content[0].tool_use_id"),
    ({"messages": _msg([{"type": "tool_result", "tool_use_id": "t", "content": 3}])}, "messages[0].content[0].content"),
    ({"messages": _msg([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}])},
     "messages[0].content[0].content[0].type"),
    ({"messages": _msg([{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}])},
     "messages[0].content[0].is_error"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages[0].content[0].id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]},
     "messages[0].content[0].name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     "messages[0].content[0].input"),
    ({"system": 3}, "system"), ({"system": [{"type": "image"}]}, "system[0].type"), ({"system": ["x"]}, "system[0]"),
    ({"system": [{"type": "text", "text": None}]}, "system[0].text"),
    ({"tools": "x"}, "tools"), ({"tools": [WEATHER] * 65}, "tools"), ({"tools": [3]}, "tools[0]"),
    ({"tools": [{"description": "no name"}]}, "tools[0].name"), ({"tools": [{"name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": "x"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "description": 3}]}, "tools[0].description"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "description": "d" * 70000}}]}, "tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"), ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
     "tool_choice.disable_parallel_tool_use"),
    ({"stop_sequences": "x"}, "stop_sequences"), ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": ["a" * 1025]}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"), ({"temperature": 1e9}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 2}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2 ** 40}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"metadata": "x"}, "metadata"), ({"metadata": {"user_id": 3}}, "metadata.user_id"),
    ({"metadata": {"user_id": "u" * 300}}, "metadata.user_id"), ({"stream": "yes"}, "stream"),
    ({"thinking": "on"}, "thinking"),
    (LONG, "messages"),        # past the 256-token context (count_tokens counts it)
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_hostile_bodies_are_4xx_in_anthropic_shape(server, path):
    base = {"model": server.model, "max_tokens": 4, "messages": ASK}
    for change, field in HOSTILE:
        body = {k: v for k, v in {**base, **change}.items() if v is not None}
        if path.endswith("count_tokens") and field in ("max_tokens", "temperature", "top_p", "top_k",
                                                        "stop_sequences", "metadata", "metadata.user_id",
                                                        "stream", "thinking"):
            continue       # count_tokens reads only the prompt's fields
        if path.endswith("count_tokens") and change is LONG:
            continue
        r = server.http.post(path, json=body)
        msg = _assert_error_shape(r)
        assert 400 <= r.status_code < 500, (change, r.status_code, msg)
        assert msg.startswith(field + ":"), (change, msg)
        expected = 404 if change.get("model") == "claude-nope" else 400
        assert r.status_code == expected, (change, r.status_code, msg)
    if path == "/v1/messages":
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            server.client.messages.create(model=server.model, max_tokens=0, messages=ASK)
        with pytest.raises(anthropic.NotFoundError):
            server.client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    for raw, ctype, status in ((b"{oops", "application/json", 400), (b"[1]", "application/json", 400),
                               (b"{}", "text/plain", 415), (b"x" * (5 << 20), "application/json", 413)):
        r = server.http.post(path, content=raw, headers={"content-type": ctype})
        assert r.status_code == status, (raw[:10], r.status_code)
        _assert_error_shape(r)
    r = server.http.get(path)
    assert r.status_code == 405
    _assert_error_shape(r)
    assert server.app.state.jx.internal_errors == 0
    # the engine still serves
    assert _create(server, max_tokens=3, messages=ASK).usage.output_tokens >= 1
    assert server.app.state.jx.internal_errors == 0


def test_long_max_tokens_is_capped_by_the_context(server):
    """Claude Code asks for max_tokens far above a small model's context: the reply stops at
    the context length (stop_reason max_tokens) instead of the request failing."""
    n = server.client.messages.count_tokens(model=server.model, messages=ASK).input_tokens
    stream = _sse(server, {"model": server.model, "max_tokens": 32000, "messages": ASK, "temperature": 0})
    delta = [d for k, d in stream if k == "message_delta"][0]
    assert delta["usage"]["output_tokens"] <= server.context - n
    if delta["delta"]["stop_reason"] == "max_tokens":
        assert delta["usage"]["output_tokens"] == server.context - n

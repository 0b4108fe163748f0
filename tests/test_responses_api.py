"""The OpenAI Responses API (``/v1/responses``, serving/responses_*.py) against the REAL tiny
engine (tests/tiny_server.py) behind the real server, driven by the official ``openai``
client: plain and item input, streaming (OpenAI's event order, deltas that add up to the
answer), the function-tool loop, ``text.format`` JSON schemas (checked with ``jsonschema``),
``previous_response_id``, retrieve / delete; greedy text equal to /v1/chat/completions for
the same conversation; the store's bounds (count, age on a fake clock, size); hostile bodies
answered 4xx in OpenAI's error shape naming the field, never a 500.

The chat template is a short one that reads ``tools`` (as Qwen's does) and lists their
names only: the SmolLM2 template writes every tool's schema into a system message, beyond
the tiny model's 128-token context. Both routes render with it, so they stay comparable.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from test_engine_safety import FailNext  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from serving.app import build_app  # noqa: E402
from serving.responses_store import ResponseStore  # noqa: E402

TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
             "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}
MAX_ENTRIES, TTL_S, MAX_ENTRY_BYTES = 6, 100.0, 32 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine()
    aeng.tokenizer.hf.chat_template = TEMPLATE
    clock = FakeClock()
    store = ResponseStore(max_entries=MAX_ENTRIES, ttl_s=TTL_S, max_entry_bytes=MAX_ENTRY_BYTES, clock=clock)
    app = build_app(aeng, response_store=store)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield SimpleNamespace(url=url, app=app, aeng=aeng, http=http, client=client, clock=clock, store=store)
    asyncio.run(aeng.shutdown())


def create(server, **kw):
    return server.client.responses.create(model=MODEL_NAME, temperature=0, **kw)


def chat(server, messages, max_tokens, **kw):
    return server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, **kw)


def assert_matches_chat(r, c) -> None:
    """A Responses answer and a chat completion of the same conversation, greedy."""
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")


# ---------------------------------------------------------------------- text

def test_plain_text_input_equals_chat_completions(server):
    r = create(server, input="Tell me a story about a cat.", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output[0].content[0].annotations == []
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 12 and r.store is True and r.tools == [] and r.tool_choice == "auto"
    assert_matches_chat(r, chat(server, [{"role": "user", "content": "Tell me a story about a cat."}], 12))
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_item_input_with_instructions_equals_chat_completions(server):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "What is two plus two?"}]
    r = create(server, input=items, instructions="You are terse.", max_output_tokens=10)
    assert r.instructions == "You are terse."
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is two plus two?"}]
    assert_matches_chat(r, chat(server, msgs, 10))
    # a different conversation is a different prompt: the comparison can tell them apart
    other = create(server, input=items[1:], instructions="You are terse.", max_output_tokens=10)
    assert other.usage.input_tokens < r.usage.input_tokens


# ---------------------------------------------------------------------- streaming

def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(the SSE ``event:`` line, the JSON data) of each event, read without the client."""
    out, event = [], None
    with server.http.stream("POST", "/v1/responses", json={"model": MODEL_NAME, **body}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[len("data: "):])))
                event = None
    return out


def check_event_order(events: list[dict]) -> None:
    """OpenAI's documented order: created, in_progress, then per output item: added,
    (content_part.added, output_text.delta*, output_text.done, content_part.done) for a
    message, the same with reasoning_text for a reasoning item (first), or
    (function_call_arguments.delta*, .done) for a call, done; then the end."""
    types = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert types[-1] == "response." + events[-1]["response"]["status"]
    i, index = 2, 0
    while i < len(types) - 1:
        assert types[i] == "response.output_item.added" and events[i]["output_index"] == index, types
        item = events[i]["item"]
        i += 1
        if item["type"] == "reasoning":      # --reasoning-parser: the thinking, before all else
            assert index == 0 and types[i] == "response.content_part.added", types
            i += 1
            while types[i] == "response.reasoning_text.delta":
                assert events[i]["item_id"] == item["id"] and events[i]["output_index"] == index
                i += 1
            assert types[i:i + 2] == ["response.reasoning_text.done", "response.content_part.done"], types
            i += 2
        elif item["type"] == "message":
            assert types[i] == "response.content_part.added"
            i += 1
            while types[i] == "response.output_text.delta":
                assert events[i]["item_id"] == item["id"] and events[i]["output_index"] == index
                i += 1
            assert types[i:i + 2] == ["response.output_text.done", "response.content_part.done"], types
            i += 2
        else:
            assert item["type"] == "function_call"
            while types[i] == "response.function_call_arguments.delta":
                i += 1
            assert types[i] == "response.function_call_arguments.done", types
            i += 1
        assert types[i] == "response.output_item.done" and events[i]["item"]["id"] == item["id"], types
        i, index = i + 1, index + 1
    assert index == len(events[-1]["response"]["output"])


def runs(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def test_stream_event_order_and_deltas_equal_the_answer(server):
    body = {"input": "Write a haiku about rain.", "max_output_tokens": 14, "temperature": 0}
    raw = raw_events(server, {**body, "stream": True})
    assert all(ev == data["type"] for ev, data in raw)       # each event: line names its type
    events = [d for _, d in raw]
    check_event_order(events)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")["text"]
    final = events[-1]["response"]
    assert deltas == done == final["output"][0]["content"][0]["text"] and deltas
    # the client parses the same stream; streamed == not streamed, greedy
    streamed = list(create(server, input=body["input"], max_output_tokens=14, stream=True))
    # how many deltas depends on how the engine's outputs were batched on the way: compare
    # the order with each run of deltas as one
    assert runs([e.type for e in streamed]) == runs([e["type"] for e in events])
    plain = create(server, input=body["input"], max_output_tokens=14)
    assert streamed[-1].response.output_text == plain.output_text == deltas
    assert streamed[-1].response.usage.output_tokens == plain.usage.output_tokens
    # a streamed response is stored when it completes
    got = server.client.responses.retrieve(final["id"])
    assert got.output_text == deltas and got.status == final["status"]


def test_mid_stream_failure_ends_with_response_failed(server):
    engine = server.aeng.engine
    hook = engine.fault_hook = FailNext()
    try:
        hook.arm(skip=3)   # the prefill and two decode steps stream, then a step fails
        raw = raw_events(server, {"input": "Count to ten.", "max_output_tokens": 20, "temperature": 0,
                                  "stream": True})
    finally:
        engine.fault_hook = None
    types = [d["type"] for _, d in raw]
    assert types[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"], types
    failed = raw[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
    with pytest.raises(openai.NotFoundError):       # a failed response is not stored
        server.client.responses.retrieve(failed["id"])
    assert server.app.state.jx.internal_errors == 0
    assert create(server, input="Still there?", max_output_tokens=3).usage.output_tokens == 3


# ---------------------------------------------------------------------- tools and formats

def _call(r) -> object:
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    c = calls[0]
    assert c.name == "get_weather" and c.call_id and c.id and c.status == "completed"
    jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    return c


def test_function_tool_loop(server):
    ask = "What is the weather in Paris?"
    r1 = create(server, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    call = _call(r1)
    assert r1.tools[0].name == "get_weather" and r1.tool_choice == "required"
    # streamed: the same call, as function_call_arguments events
    events = list(create(server, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=40,
                         stream=True))
    check_event_order([e.model_dump() for e in events])
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and _call(events[-1].response).arguments == call.arguments
    # the tool's answer goes back with previous_response_id
    result = json.dumps({"temperature": 21})
    r2 = create(server, previous_response_id=r1.id, tools=[WEATHER], max_output_tokens=8,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert r2.previous_response_id == r1.id and r2.output
    assert r2.usage.input_tokens > r1.usage.input_tokens + 10        # the call and its result are in it
    # ... and is the chat route's prompt for the same conversation
    msgs = [{"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    c = chat(server, msgs, 8, tools=[CHAT_WEATHER])
    assert r2.usage.input_tokens == c.usage.prompt_tokens
    assert r2.usage.output_tokens == c.usage.completion_tokens
    if not c.choices[0].message.tool_calls:
        assert r2.output_text.strip() == c.choices[0].message.content.strip()
    # the same call sent back as items (no previous_response_id) is the same prompt
    r3 = create(server, tools=[WEATHER], max_output_tokens=8, store=False, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text


def test_named_tool_choice(server):
    r = create(server, input="Weather?", tools=[WEATHER], max_output_tokens=40,
               tool_choice={"type": "function", "name": "get_weather"})
    _call(r)
    assert r.tool_choice.name == "get_weather"


def test_text_format_json_schema(server):
    fmt = {"format": {"type": "json_schema", "name": "status", "schema": OK_SCHEMA, "strict": True}}
    r = create(server, input="Report your status as JSON.", text=fmt, max_output_tokens=40)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), OK_SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "status"
    streamed = list(create(server, input="Report your status as JSON.", text=fmt, max_output_tokens=40,
                           stream=True))
    assert streamed[-1].response.output_text == r.output_text
    # the same schema through the chat route's response_format: the same text
    c = chat(server, [{"role": "user", "content": "Report your status as JSON."}], 40,
             response_format={"type": "json_schema", "json_schema": {"name": "status", "schema": OK_SCHEMA}})
    assert c.choices[0].message.content == r.output_text


# ---------------------------------------------------------------------- stored responses

def test_previous_response_id_equals_chat_with_the_full_conversation(server):
    r1 = create(server, input="Name a colour.", max_output_tokens=6)
    r2 = create(server, input="Now name another.", previous_response_id=r1.id, max_output_tokens=6)
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens   # holds the first turn
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "Now name another."}]
    assert_matches_chat(r2, chat(server, msgs, 6))
    # a third turn carries both
    r3 = create(server, input="And a third.", previous_response_id=r2.id, max_output_tokens=4)
    c3 = chat(server, msgs + [{"role": "assistant", "content": r2.output_text},
                              {"role": "user", "content": "And a third."}], 4)
    assert_matches_chat(r3, c3)


def test_retrieve_and_delete(server):
    r = create(server, input="Hello", max_output_tokens=4, metadata={"topic": "greeting"}, user="u1")
    got = server.client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"topic": "greeting"}
    server.client.responses.delete(r.id)
    for op in (server.client.responses.retrieve, server.client.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            op(r.id)
        assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        create(server, input="again", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = create(server, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(unstored.id)


def test_store_evicts_by_count_and_age(server):
    ids = [create(server, input=f"Item {i}", max_output_tokens=1).id for i in range(MAX_ENTRIES + 1)]
    with pytest.raises(openai.NotFoundError):     # the least recently used went first
        server.client.responses.retrieve(ids[0])
    for rid in ids[1:]:
        assert server.client.responses.retrieve(rid).id == rid
    assert len(server.store) == MAX_ENTRIES
    server.clock.t += TTL_S + 1                   # every entry's time is up
    for rid in ids[1:]:
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError) as e:
        create(server, input="x", previous_response_id=ids[-1], max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found"
    fresh = create(server, input="new", max_output_tokens=1)     # stored on the moved clock
    assert server.client.responses.retrieve(fresh.id).id == fresh.id


def test_oversized_response_is_answered_but_not_stored(server):
    # Tools shown with tool_choice "none" cost no prompt tokens but are repeated in the
    # response object: 40 KB of descriptions, over the store's 32 KB per response.
    tools = [{**WEATHER, "name": f"tool_{i}", "description": "d" * 1000} for i in range(40)]
    r = create(server, input="Hello", tools=tools, tool_choice="none", max_output_tokens=2)
    assert r.store is False and r.output_text is not None
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(r.id)


# ---------------------------------------------------------------------- hostile input

def _items(n):
    return [{"role": "user", "content": "x"}] * n


HOSTILE = [
    ({}, "input", 400),
    ({"input": 5}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": [3]}, "input[0]", 400),
    ({"input": _items(1025)}, "input", 400),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", 400),
    ({"input": [{"type": "bogus"}]}, "input[0].type", 400),
    ({"input": [{"content": "no role or type"}]}, "input[0].type", 400),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", 400),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type", 400),
    ({"input": [{"role": "user", "content": [{"type": "weird", "text": "x"}]}]}, "input[0].content[0].type", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 7}]}]},
     "input[0].content[0].text", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 65}]}, "input[0].content", 400),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", 400),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "bad name!", "arguments": "{}"}]},
     "input[0].name", 400),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]},
     "input[0].arguments", 400),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input[0].arguments", 400),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output", 400),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 200, "output": "x"}]}, "input[0].call_id", 400),
    ({"input": "x", "tools": [WEATHER] * 65}, "tools", 400),
    ({"input": "x", "tools": [{**WEATHER, "name": f"t{i}"} for i in range(65)]}, "tools", 400),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters", 400),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict", 400),
    ({"input": "x", "tools": "all"}, "tools", 400),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice", 400),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", 400),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", 400),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice", 400),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", 400),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": []}}},
     "text.format.schema", 400),
    ({"input": "x", "text": "json"}, "text", 400),
    ({"input": "x", "temperature": "hot"}, "temperature", 400),
    ({"input": "x", "temperature": -1}, "temperature", 400),
    ({"input": "x", "top_p": 7}, "top_p", 400),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens", 400),
    ({"input": "x", "max_output_tokens": 10 ** 30}, "max_output_tokens", 400),
    ({"input": "x", "max_output_tokens": 500}, "max_output_tokens", 400),
    ({"input": "x", "stream": "yes"}, "stream", 400),
    ({"input": "x", "store": 1}, "store", 400),
    ({"input": "x", "stream_options": {}}, "stream_options", 400),
    ({"input": "x", "truncation": "auto"}, "truncation", 400),
    ({"input": "x", "include": ["nonsense"]}, "include[0]", 400),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]", 400),
    ({"input": "x", "include": "all"}, "include", 400),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata", 400),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k", 400),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k", 400),
    ({"input": "x", "instructions": 5}, "instructions", 400),
    ({"input": "x", "user": "u" * 257}, "user", 400),
    ({"input": "x", "background": True}, "background", 400),
    ({"input": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls", 400),
    ({"input": "x", "model": "gpt-9"}, "model", 400),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id", 404),
    ({"input": "x", "previous_response_id": "r" * 10_000}, "previous_response_id", 404),
    ({"input": "x", "previous_response_id": 12}, "previous_response_id", 400),
    ({"input": "x" * 2000}, "input", 400),            # longer than the context
]


@pytest.mark.parametrize("body,param,status", HOSTILE, ids=[f"{p}-{i}" for i, (_, p, _s) in enumerate(HOSTILE)])
def test_hostile_bodies_get_a_4xx_naming_the_field(server, body, param, status):
    r = server.http.post("/v1/responses", json={"model": MODEL_NAME, "max_output_tokens": 2, **body})
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]
    assert server.app.state.jx.internal_errors == 0


def test_unsupported_image_says_so_and_the_engine_serves_on(server):
    r = server.http.post("/v1/responses", json={"model": MODEL_NAME, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "data:,"}]}]})
    assert r.status_code == 400 and "not supported yet" in r.json()["error"]["message"]
    for raw in (b'{"input": NaN}', b'{"input": "x", "max_output_tokens": 1' + b"0" * 5000 + b"}", b"[1, 2]",
                b'{"input": [' + b"[" * 2000 + b"]" * 2000 + b"]}"):
        r = server.http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and isinstance(r.json()["error"]["message"], str), r.text[:200]
    for method, path in (("GET", "/v1/responses/nope"), ("DELETE", "/v1/responses/nope"),
                         ("GET", "/v1/responses/" + "x" * 5000), ("PUT", "/v1/responses/nope")):
        r = server.http.request(method, path)
        assert r.status_code in (404, 405) and isinstance(r.json()["error"]["message"], str), r.text[:200]
    assert server.app.state.jx.internal_errors == 0 and not server.aeng.is_dead
    assert create(server, input="Still serving?", max_output_tokens=3).usage.output_tokens == 3


# ---------------------------------------------------------------------- the store alone

def test_store_bounds_without_a_server():
    clock = FakeClock()
    s = ResponseStore(max_entries=3, max_bytes=2000, max_entry_bytes=900, ttl_s=10, clock=clock)
    conv = [{"type": "message", "role": "user", "content": "hi"}]
    for i in range(3):
        assert s.put(f"r{i}", {"id": f"r{i}"}, conv)
    assert s.get("r0") is not None                     # r0 used: r1 is now the least recent
    assert s.put("r3", {"id": "r3"}, conv)
    assert s.get("r1") is None and {r for r in ("r0", "r2", "r3") if s.get(r)} == {"r0", "r2", "r3"}
    assert not s.put("big", {"id": "big", "x": "y" * 1000}, conv) and s.get("big") is None
    for i in range(3):                                 # 3 x ~700 bytes > 2000: bytes evict too
        assert s.put(f"m{i}", {"id": f"m{i}", "x": "y" * 600}, conv)
    assert s.bytes <= 2000 and s.get("m0") is None and s.get("m2") is not None
    clock.t += 10
    assert s.get("m2") is None and not s.delete("m1") and len(s) <= 1
    assert s.put("late", {"id": "late"}, conv) and len(s) == 1 and s.bytes == s.get("late").size
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)

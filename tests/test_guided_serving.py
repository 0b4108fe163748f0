"""Structured output and tool calling through the server with the REAL engine and the
default model, driven by the official ``openai`` client: ``response_format`` (json_schema,
json_object), vLLM's ``guided_choice``, TGI's ``grammar``, ``tools`` with a named /
required / auto choice (streaming and not), a two-turn tool-calling loop, and the 400s."""

from __future__ import annotations

import json
import os
import sys

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The real-engine server and client fixtures (same engine shape: the compilation cache
# serves both modules).
from test_serving_real import client, server  # noqa: E402,F401

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_response_format_json_schema_and_object(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "Describe a fictional person as JSON."}]
    r = client.chat.completions.create(model=server.engine.model_name, messages=msgs, max_tokens=120,
                                       temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    streamed, finish = _stream_text(client.chat.completions.create(
        model=server.engine.model_name, messages=msgs, max_tokens=120, temperature=0, response_format=fmt,
        stream=True))
    assert streamed == text and finish == "stop"
    ask = [{"role": "user", "content": 'Is the sky blue? Answer as JSON: {"answer": "yes"} or {"answer": "no"}.'}]
    r = client.chat.completions.create(model=server.engine.model_name, messages=ask, max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_choice_and_tgi_grammar(server, client):
    r = client.completions.create(model=server.engine.model_name, prompt="The sky is", max_tokens=8,
                                  temperature=0, extra_body={"guided_choice": ["blue", "green", "red"]})
    assert r.choices[0].text in ("blue", "green", "red")
    body = {"inputs": "My phone number is", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}}}
    g = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert len(g["generated_text"]) == 8 and g["generated_text"][3] == "-", g


def test_invalid_constraints_are_400_with_the_library_message(server, client):
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        client.chat.completions.create(model=server.engine.model_name, messages=ASK, max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(ab"})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=server.engine.model_name, messages=ASK, max_tokens=8, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    r = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "(ab"}}}, timeout=60)
    assert r.status_code == 422 and "unclosed group" in r.json()["error"]


def _check_call(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tools_named_and_required_stream_and_not(server, client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=server.engine.model_name, messages=ASK, max_tokens=60,
                                           temperature=0, tools=[WEATHER, TIME], tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        tool = WEATHER if c.message.tool_calls[0].function.name == "get_weather" else TIME
        args = _check_call(c.message.tool_calls[0], tool)
        # streamed: the same call, as OpenAI's tool-call deltas
        calls, finish = {}, None
        for chunk in client.chat.completions.create(model=server.engine.model_name, messages=ASK, max_tokens=60,
                                                    temperature=0, tools=[WEATHER, TIME], tool_choice=choice,
                                                    stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    cur = calls.setdefault(tc.index, {"name": "", "args": ""})
                    cur["name"] += (tc.function.name or "") if tc.function else ""
                    cur["args"] += (tc.function.arguments or "") if tc.function else ""
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] == tool["function"]["name"] and json.loads(calls[0]["args"]) == args


def test_two_turn_tool_loop(server, client):
    msgs = list(ASK)
    r = client.chat.completions.create(model=server.engine.model_name, messages=msgs, max_tokens=60,
                                       temperature=0, tools=[WEATHER], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    args = _check_call(call, WEATHER)
    msgs.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    msgs.append({"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"city": args["city"], "temperature": 21, "unit": args["unit"]})})
    r2 = client.chat.completions.create(model=server.engine.model_name, messages=msgs, max_tokens=40,
                                        temperature=0, tools=[WEATHER], tool_choice="auto")
    c = r2.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    # the second prompt carries the first call and the tool's answer
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 20


def test_unconstrained_neighbours_keep_their_tokens(server, client):
    """Plain greedy requests sent together with constrained ones get the tokens they get alone."""
    from concurrent.futures import ThreadPoolExecutor

    model = server.engine.model_name
    plain = lambda p: client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)  # noqa: E731
    alone = [plain(p).choices[0].text for p in ("The capital of France is", "def add(a, b):")]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "Describe a fictional person as JSON."}]
    with ThreadPoolExecutor(4) as pool:
        # PERSON bounds every string and array: 160 tokens always reach the end
        guided = [pool.submit(client.chat.completions.create, model=model, messages=msgs, max_tokens=160,
                              temperature=0.7, seed=i, response_format=fmt) for i in range(2)]
        mixed = [pool.submit(plain, p) for p in ("The capital of France is", "def add(a, b):")]
        assert [f.result().choices[0].text for f in mixed] == alone
        for f in guided:
            c = f.result().choices[0]
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), PERSON)


def test_tool_choice_auto_streamed_through_the_client(server, client):
    """tool_choice auto, streamed: whatever the model chooses, the stream is well formed
    (content deltas, or tool-call deltas whose arguments parse) and equals the same request
    not streamed."""
    kw = dict(model=server.engine.model_name, messages=ASK, max_tokens=60, temperature=0,
              tools=[WEATHER, TIME], tool_choice="auto")
    r = client.chat.completions.create(**kw).choices[0]
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, {"name": "", "args": ""})
                cur["name"] += (tc.function.name or "") if tc.function else ""
                cur["args"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == r.finish_reason
    if r.message.tool_calls:
        assert finish == "tool_calls"
        assert [c["name"] for c in calls.values()] == [c.function.name for c in r.message.tool_calls]
        assert [json.loads(c["args"]) for c in calls.values()] == [
            json.loads(c.function.arguments) for c in r.message.tool_calls]
    else:
        assert not calls and text == r.message.content


def test_guided_json_grammar_and_logit_bias_requests(server, client):
    """vLLM's guided_json and guided_grammar, and OpenAI's logit_bias, over HTTP."""
    model = server.engine.model_name
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.completions.create(model=model, prompt="Answer as JSON:", max_tokens=20, temperature=0,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    lark = 'start: "yes" | "no" | "maybe"'
    r = client.completions.create(model=model, prompt="Will it rain?", max_tokens=8, temperature=0,
                                  extra_body={"guided_grammar": lark})
    assert r.choices[0].text in ("yes", "no", "maybe")
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0)
    first = server.engine.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_grammar_over_the_size_limit_is_400(server, client):
    """A regex or a JSON schema over the grammar size limit comes back as a 400 that says so
    (never a 500, never a hung request), and the server keeps serving."""
    with pytest.raises(openai.BadRequestError, match="over the limit"):
        client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a" * 70_000})
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,9}"}
                                            for i in range(1500)}}
    with pytest.raises(openai.BadRequestError, match="over the limit"):
        client.chat.completions.create(model=server.engine.model_name, messages=ASK, max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "big", "schema": big}})
    r = client.completions.create(model=server.engine.model_name, prompt="The sky is", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")      # the server still serves

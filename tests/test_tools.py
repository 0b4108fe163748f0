"""Tool calling's host side (serving/tools.py): request parsing, the call grammar, the
parser for the Hermes / Qwen and SmolLM2 formats, rendering with and without a template
that reads ``tools``. No model: milliseconds."""

from __future__ import annotations

import json

import pytest

from serving import tools as T
from serving.errors import ProtocolError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def spec(choice="auto"):
    return T.parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})


def test_parse_tools_and_choices():
    assert T.parse_tools({}) is None
    assert T.parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert spec().choice == "auto" and not spec().constrained
    assert spec("required").constrained
    named = spec({"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "named" and named.named == "get_time"
    assert named.functions[1]["parameters"] == {"type": "object", "properties": {}}
    for body, param in [({"tools": "x"}, "tools"), ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
                         "tools[0].function.parameters"),
                        ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(ProtocolError) as e:
            T.parse_tools(body)
        assert e.value.param == param


def test_parse_qwen_and_smollm_formats():
    qwen = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = T.parse_tool_calls(qwen, spec())
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert len({c["id"] for c in calls}) == 2
    smol = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    content, calls = T.parse_tool_calls(smol, spec())
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    # unknown function, broken JSON, plain text: left as content
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                 "It is sunny."):
        assert T.parse_tool_calls(text, spec()) == (text, [])


def test_call_grammar_accepts_only_allowed_calls():
    import llguidance

    from jaxinfer.engine.guided import grammar_text
    from jaxinfer.sampling_params import GuidedDecoding

    g = grammar_text(GuidedDecoding.parse(T.call_grammar(spec({"type": "function", "function": {"name": "get_weather"}}))))
    assert llguidance.LLMatcher.validate_grammar(g) == ""
    assert 'get_weather' in g and 'get_time' not in g


class _Tok:
    def __init__(self, template):
        self.chat_template = template
        self.seen = None

    def apply_chat_template(self, messages, add_generation_prompt=True, template_kwargs=None):
        self.seen = messages
        return [1, 2, 3]


def test_tools_go_to_a_system_message_when_the_template_cannot_render_them():
    tok = _Tok("{% for m in messages %}{{ m.content }}{% endfor %}")
    T.render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], spec(), tok)
    assert tok.seen[0]["role"] == "system" and tok.seen[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in tok.seen[0]["content"] and "<tool_call>" in tok.seen[0]["content"]
    assert tok.seen[1] == {"role": "user", "content": "hi"}


def test_assistant_calls_are_written_back_in_the_model_format():
    text = T.assistant_calls_text([{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}], "messages[1].tool_calls")
    _, calls = T.parse_tool_calls(text, spec())
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    with pytest.raises(ProtocolError):
        T.assistant_calls_text([{"function": {"name": "f", "arguments": "{"}}], "x")


class _Streamer:
    def __init__(self, tool_spec):
        self.req = type("R", (), {"tools": tool_spec})()
        self.held = {}


def _deltas(tool_spec, pieces):
    from types import SimpleNamespace

    st, out = _Streamer(tool_spec), []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        out += T.stream_tool_deltas(st, SimpleNamespace(index=0, text=p, finish_reason="stop" if last else None,
                                                        stop_reason=None))
    return out


def test_stream_auto_content_flows_and_calls_come_as_deltas():
    text = _deltas(spec(), ["It is ", "sunny <tool", "_ca", "ll>no json</tool_call>", "."])
    content = "".join(c["delta"].get("content", "") for c in text)
    assert text[0]["delta"] == {"content": "It is "} and content == "It is sunny <tool_call>no json</tool_call>."
    assert text[-1]["finish_reason"] == "stop"
    call = _deltas(spec(), ["Sure. <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city": "Rome"}}</tool_call>'])
    assert call[0]["delta"] == {"content": "Sure. "}
    tc = [c["delta"]["tool_calls"][0] for c in call if "tool_calls" in c["delta"]]
    assert tc[0]["function"] == {"name": "get_weather", "arguments": ""} and tc[0]["id"].startswith("call_")
    assert json.loads(tc[1]["function"]["arguments"]) == {"city": "Rome"}
    assert call[-1]["finish_reason"] == "tool_calls"
    held = _deltas(spec("required"), ["<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"])
    assert all("content" not in c["delta"] for c in held) and held[-1]["finish_reason"] == "tool_calls"


def test_gbnf_grammars_are_converted():
    import llguidance

    from jaxinfer.engine.guided import grammar_text
    from jaxinfer.sampling_params import GuidedDecoding

    g = grammar_text(GuidedDecoding.parse({"grammar": 'root ::= "yes" | "no" ws\nws ::= [ ]*'}))
    assert llguidance.LLMatcher.validate_grammar(g) == ""


def test_a_template_that_reads_tools_renders_them():
    from types import SimpleNamespace

    seen = {}

    def render(messages, add_generation_prompt=True, template_kwargs=None, tools=None):
        seen.update(messages=messages, tools=tools)
        return "rendered"

    tok = SimpleNamespace(chat_template="{% if tools %}{{ tools }}{% endif %}", render_chat=render,
                          encode=lambda text, add_special_tokens=False: [len(text)])
    msgs = [{"role": "user", "content": "hi"}]
    assert T.render_messages(msgs, spec(), tok) == [len("rendered")]
    assert seen["messages"] == msgs and [t["function"]["name"] for t in seen["tools"]] == ["get_weather", "get_time"]

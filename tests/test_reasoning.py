"""Reasoning output (--reasoning-parser): the parsers' whole-text split and streamed split,
the chat route's reasoning_content (streamed and not) on the real tiny engine, and
chat_template_kwargs reaching the template."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import pytest

from serving.reasoning import PARSER_NAMES, reasoning_parser

# vLLM 0.32's own answers (extract_reasoning of its DeepSeekR1ReasoningParser and
# Qwen3ParserReasoningAdapter, run on these texts): the oracle for the whole-text split.
# vLLM's None content is "" here. r1 differs from vLLM only where vLLM's split cannot be
# streamed (text before a <think>, a <think> after </think>: see serving/reasoning.py).
VLLM_SPLITS = {
    ("deepseek_r1", ()): [
        ("abc", ("abc", "")), ("<think>abc</think>xyz", ("abc", "xyz")),
        ("abc</think>xyz", ("abc", "xyz")), ("<think>abc", ("abc", "")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")), ("<think>a<think>b</think>c", ("a<think>b", "c")),
        ("abc</think>", ("abc", "")), ("a</think>\n\nb", ("a", "\n\nb")),
    ],
    ("qwen3", ()): [
        ("abc", ("abc", "")), ("<think>abc</think>xyz", ("abc", "xyz")), ("abc</think>xyz", ("abc", "xyz")),
        ("<think>abc", ("abc", "")), ("x<think>abc</think>xyz", ("xabc", "xyz")),
        ("<think>a</think>b</think>c", ("a", "bc")), ("<think>a<think>b</think>c", ("ab", "c")),
        ("a</think>b<think>c", ("a", "b<think>c")), ("abc<tool_call>x</tool_call>y", ("abc", "<tool_call>x</tool_call>y")),
        ("<think></think>x", (None, "x")), ("</think>", (None, "")), ("a</thi", ("a</thi", "")),
        ("<think>\n</think>\n\n", ("\n", "\n\n")),
    ],
    ("qwen3", (("enable_thinking", False),)): [
        ("<think>abc</think>xyz", (None, "<think>abc</think>xyz")), ("abc</think>", (None, "abc</think>")),
    ],
    ("deepseek_v3", ()): [("<think>abc</think>xyz", (None, "<think>abc</think>xyz"))],
    ("deepseek_v3", (("thinking", True),)): [("<think>abc</think>xyz", ("abc", "xyz")), ("abc", ("abc", ""))],
}


@pytest.mark.parametrize("key", list(VLLM_SPLITS), ids=lambda k: f"{k[0]}{dict(k[1]) or ''}")
def test_split_matches_vllm(key):
    name, kw = key
    p = reasoning_parser(name, dict(kw))
    for text, want in VLLM_SPLITS[key]:
        assert p.split(text) == want, text


def _streamed(parser, text: str, rng: random.Random) -> tuple[str | None, str]:
    s = parser.stream()
    r, c, i = [], [], 0
    while i < len(text):
        j = min(len(text), i + rng.choice((0, 1, 1, 2, 3, 5, 8)))
        dr, dc = s.feed(text[i:j])
        r.append(dr)
        c.append(dc)
        i = j
    dr, dc = s.finish()
    return "".join(r + [dr]) or None, "".join(c + [dc])


_PIECES = ["<think>", "</think>", "<tool_call>", "<", "/", "think", ">", "</", "<th", "ink>", "a", "b", " ",
           "\n", "é", "</thi", "<think"]
_KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"thinking": True}]


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_streamed_deltas_join_to_the_split_for_any_cut(name):
    rng = random.Random(f"reasoning-{name}")
    for seed in range(3000):
        kw = _KWARGS[seed % len(_KWARGS)]
        p = reasoning_parser(name, kw)
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12)))
        assert _streamed(p, text, rng) == p.split(text), (seed, kw, text)


def test_a_tag_split_across_deltas_is_held_until_decided():
    s = reasoning_parser("deepseek_r1").stream()
    assert s.feed("<thi") == ("", "")            # could still be <think>
    assert s.feed("nk>I am ") == ("I am ", "")
    assert s.feed("thinking</th") == ("thinking", "")
    assert s.feed("ink>The") == ("", "The")
    assert s.feed(" answer</think>") == ("", " answer</think>")   # after the end: verbatim content
    assert s.finish() == ("", "")


def test_a_held_tail_that_never_becomes_a_tag_is_released_at_the_end():
    s = reasoning_parser("qwen3").stream()
    assert s.feed("<think>x</thi") == ("x", "")
    assert s.finish() == ("</thi", "")
    s = reasoning_parser("qwen3").stream()
    assert s.feed("x</think>y<tool") == ("x", "y<tool")     # no tag is watched for there in content


def test_no_tags_only_an_opening_tag_and_text_after_the_end():
    r1, q3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
    assert r1.split("no tags at all") == ("no tags at all", "")   # the template opened <think>
    assert r1.split("<think>still thinking") == ("still thinking", "")
    assert q3.split("<think>still thinking") == ("still thinking", "")
    assert r1.split("<think>a</think>b <think>c</think> d") == ("a", "b <think>c</think> d")
    assert reasoning_parser("qwen3", {"enable_thinking": False}).split("no tags") == (None, "no tags")
    assert reasoning_parser("deepseek_v3").split("<think>a</think>b") == (None, "<think>a</think>b")


def test_unknown_parser_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        reasoning_parser("nope")
    assert reasoning_parser(None) is None


def test_serve_flag_lists_the_choices(capsys):
    import argparse

    from serving.server import add_serve_args

    ap = argparse.ArgumentParser()
    add_serve_args(ap)
    assert ap.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert ap.parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit):
        ap.parse_args(["--reasoning-parser", "r2d2"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and all(n in err for n in PARSER_NAMES), err


# ------------------------------------------------------------------ the chat route, real engine

# ChatML that, like Qwen3's, closes an empty think block in the prompt when thinking is off
# (and names the tools briefly: the tiny model's context is short).
TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
# The tiny random model never thinks by itself: a grammar makes it write the tags.
THINKING = r"<think>([a-z ]{1,20})</think>([a-z ]{1,20})"
TOOL = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{\\}\\}\\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def servers():
    from serving.app import build_app
    from tests.mock_engine import serve_in_thread
    from tests.tiny_server import tiny_async_engine

    aeng = tiny_async_engine()
    aeng.engine.tokenizer.hf.chat_template = TEMPLATE
    apps = {name: build_app(aeng, shutdown_engine=False, reasoning_parser=name)
            for name in (None, "deepseek_r1", "qwen3")}
    with serve_in_thread(apps[None]) as plain, serve_in_thread(apps["deepseek_r1"]) as r1, \
            serve_in_thread(apps["qwen3"]) as q3, httpx.Client(timeout=120) as http:
        yield SimpleNamespace(plain=plain, deepseek_r1=r1, qwen3=q3, http=http)
    asyncio.run(aeng.shutdown())


def _body(regex: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0,
            "max_tokens": 80, "guided_regex": regex, **kw}


def _chat(servers, url: str, body: dict) -> dict:
    r = servers.http.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(servers, url: str, body: dict) -> tuple[str | None, str | None, list, str]:
    """The streamed chunks joined: (reasoning_content, content, tool_calls deltas, finish_reason)."""
    thought, content, calls, finish = [], [], [], None
    with servers.http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                d = ch["delta"]
                assert d.get("reasoning_content") == d.get("reasoning")
                thought.append(d.get("reasoning_content") or "")
                content.append(d.get("content") or "")
                calls += d.get("tool_calls") or []
                finish = ch["finish_reason"] or finish
    return "".join(thought) or None, "".join(content) or None, calls, finish


def test_reasoning_content_is_the_thinking_and_streams_the_same(servers):
    import re

    body = _body(THINKING)
    plain = _chat(servers, servers.plain, body)["choices"][0]["message"]
    assert "reasoning_content" not in plain          # no parser: the reply as it was
    m = re.fullmatch(THINKING, plain["content"])
    assert m, plain
    for url in (servers.deepseek_r1, servers.qwen3):
        msg = _chat(servers, url, body)["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == (m.group(1), m.group(2)), msg
        assert msg["reasoning"] == msg["reasoning_content"]
        assert _stream(servers, url, body)[:2] == (m.group(1), m.group(2))


def test_include_reasoning_false_drops_it(servers):
    msg = _chat(servers, servers.deepseek_r1, _body(THINKING, include_reasoning=False))["choices"][0]["message"]
    plain = _chat(servers, servers.plain, _body(THINKING))["choices"][0]["message"]["content"]
    assert msg["reasoning_content"] is None and msg["content"] == plain.split("</think>", 1)[1]


def test_openai_client_reads_reasoning_content(servers):
    import openai

    client = openai.OpenAI(base_url=servers.qwen3 + "/v1", api_key="x")
    body = _body(THINKING)
    extra = {"guided_regex": body.pop("guided_regex")}
    out = client.chat.completions.create(model="tiny-random-llama", extra_body=extra, **body)
    msg = out.choices[0].message
    chunks = client.chat.completions.create(model="tiny-random-llama", extra_body=extra, stream=True, **body)
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert msg.model_extra["reasoning_content"] and streamed == msg.model_extra["reasoning_content"]


def test_enable_thinking_reaches_the_template_and_the_parser(servers):
    on = _chat(servers, servers.qwen3, _body(THINKING))
    off = _chat(servers, servers.qwen3, _body(THINKING, chat_template_kwargs={"enable_thinking": False}))
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]    # the template closed a think block
    msg = off["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"].startswith("<think>")   # qwen3: thinking off


def test_tool_calls_are_parsed_from_the_content_only(servers):
    import re

    called = _body(r"<think>[a-z ]{1,10}</think>" + TOOL, tools=TOOLS)
    msg = _chat(servers, servers.deepseek_r1, called)["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["reasoning_content"]
    assert [c["function"]["name"] for c in msg["message"]["tool_calls"]] == ["get_weather"]
    thought, content, calls, finish = _stream(servers, servers.deepseek_r1, called)
    assert thought == msg["message"]["reasoning_content"] and finish == "tool_calls" and len(calls) == 2
    # a call written inside the thinking is thinking, not a call
    inside = _body(r"<think>" + TOOL + r"</think>[a-z ]{1,10}", tools=TOOLS)
    msg = _chat(servers, servers.deepseek_r1, inside)["choices"][0]
    assert msg["finish_reason"] != "tool_calls" and not msg["message"]["tool_calls"]
    assert re.fullmatch(TOOL.replace("\\n", "\n"), msg["message"]["reasoning_content"])
    assert _stream(servers, servers.deepseek_r1, inside)[:3] == (msg["message"]["reasoning_content"],
                                                                msg["message"]["content"], [])


@pytest.mark.parametrize("kwargs, param", [
    ("yes", "chat_template_kwargs"),
    ({"enable_thinking": {"a": 1}}, "chat_template_kwargs.enable_thinking"),
    ({"x": [1, 2]}, "chat_template_kwargs.x"),
    ({"x": "y" * 5000}, "chat_template_kwargs.x"),
    ({f"k{i}": 1 for i in range(40)}, "chat_template_kwargs"),
    ({"not a name": 1}, "chat_template_kwargs"),
    ({"tokenize": True}, "chat_template_kwargs"),
    ({"chat_template": "{{ 7 * 7 }}"}, "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(servers, kwargs, param):
    r = servers.http.post(servers.qwen3 + "/v1/chat/completions",
                          json={**_body(THINKING), "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ Anthropic Messages

def _anthropic(url: str):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="x")


def _messages_body(**kw) -> dict:
    return dict(model="tiny-random-llama", max_tokens=24, messages=[{"role": "user", "content": "Think, then answer."}],
                extra_body={"temperature": 0}, **kw)


def test_anthropic_thinking_block_is_the_reply_streamed_and_not(servers):
    """The Messages route has no guided fields, so the tiny model writes no tags: deepseek_r1
    reads a reply without ``</think>`` as all thinking (its template opened the block)."""
    import re

    plain = _anthropic(servers.plain).messages.create(**_messages_body())
    assert [b.type for b in plain.content] == ["text"] and "think>" not in plain.content[0].text
    client = _anthropic(servers.deepseek_r1)
    msg = client.messages.create(**_messages_body())
    assert [(b.type, b.thinking) for b in msg.content] == [("thinking", plain.content[0].text)]
    with client.messages.stream(**_messages_body()) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    unsigned = lambda m: [b.model_dump(exclude={"signature"}) for b in m.content]    # noqa: E731
    assert unsigned(final) == unsigned(msg) and final.content[0].signature
    assert re.fullmatch(r"(thinking_delta )+signature_delta ", "".join(d + " " for d in deltas)), deltas


def test_anthropic_thinking_disabled_and_thinking_history(servers):
    client = _anthropic(servers.qwen3)
    on = client.messages.create(**_messages_body())
    off = client.messages.create(**_messages_body(thinking={"type": "disabled"}))
    assert off.usage.input_tokens > on.usage.input_tokens       # the template closed a think block
    assert [b.type for b in on.content] == ["thinking"] and [b.type for b in off.content] == ["text"]
    # the reply sent back, thinking block and all, is a valid next turn (the thinking dropped)
    history = [{"role": "user", "content": "Think, then answer."},
               {"role": "assistant", "content": [b.model_dump() for b in on.content] + [{"type": "text", "text": "ok"}]},
               {"role": "user", "content": "Again."}]
    again = client.messages.create(**{**_messages_body(), "messages": history})
    history[1]["content"] = [{"type": "text", "text": "ok"}]
    assert again.usage.input_tokens == client.messages.create(**{**_messages_body(), "messages": history}).usage.input_tokens


def _blocks_from_events(chunks: list[bytes]) -> tuple[list[dict], str]:
    """Anthropic's stream read back as its docs define it: blocks from their start and deltas;
    and the delta types in order."""
    blocks, kinds = [], []
    for c in chunks:
        head, data = c.decode().strip().split("\n")
        ev = json.loads(data.removeprefix("data: "))
        if ev["type"] == "content_block_start":
            assert ev["index"] == len(blocks)
            blocks.append(dict(ev["content_block"], **({"partial": ""} if ev["content_block"]["type"] == "tool_use" else {})))
        elif ev["type"] == "content_block_delta":
            b, d = blocks[ev["index"]], ev["delta"]
            kinds.append(d["type"])
            key = {"thinking_delta": "thinking", "text_delta": "text", "signature_delta": "signature",
                   "input_json_delta": "partial"}[d["type"]]
            b[key] = b.get(key, "") + d[{"input_json_delta": "partial_json"}.get(d["type"], key)]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial"))
            b.pop("id")
    return blocks, " ".join(kinds)


def test_anthropic_stream_of_any_cut_is_the_whole_reply():
    """Thinking, then text or a tool call, cut at random: the streamed blocks are the
    message's, thinking deltas first (unit: the Dialect's builders over outputs)."""
    import re

    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.sampling_params import SamplingParams
    from serving.anthropic_response import AnthropicStream, message_response
    from serving.dialect import Answering
    from serving.request import GenRequest
    from serving.tools import ToolSpec

    spec = ToolSpec(({"name": "get_weather", "description": "", "parameters": {}},), "auto")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    texts = ["<think>hm, rain?</think>Take a coat.", "<think>hm</think>" + call, "still thinking </thi",
             "no end tag at all", "<think>a</think>", "</think>only an answer"]
    rng = random.Random(7)
    for seed in range(200):
        text, name = texts[seed % len(texts)], ("deepseek_r1", "qwen3")[seed % 2]
        req = GenRequest("messages", "m", [1, 2], "", SamplingParams(), stream=True, tools=spec,
                         reasoning=reasoning_parser(name))
        out = lambda n, fin: RequestOutput("r", None, [1, 2], [CompletionOutput(0, text[:n], list(range(n)), fin, None)],
                                           finished=fin is not None)
        s, chunks, n = AnthropicStream(req, Answering(None, frozenset())), [], 0
        while n < len(text):
            n = min(len(text), n + rng.randint(1, 6))
            chunks += s.events(out(n, "stop" if n == len(text) and rng.random() < 0.5 else None))
        chunks += s.end(out(len(text), "stop"))
        want = message_response(req, out(len(text), "stop"), None)["content"]
        for b in want:
            b.pop("id", None)
        blocks, kinds = _blocks_from_events([c for c in chunks if b"content_block_" in c])
        assert blocks == want, (seed, text, blocks, want)
        assert re.fullmatch(r"((thinking_delta )*thinking_delta signature_delta ?)?.*", kinds), kinds
        assert "thinking_delta" not in kinds.split("signature_delta")[-1], kinds


# ------------------------------------------------------------------ Responses API

def _sse(servers, url: str, body: dict) -> list[dict]:
    with servers.http.stream("POST", url + "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def _no_ids(items: list[dict]) -> list[dict]:
    """Items less their per-request ids (a call's ``call_id`` is drawn fresh each parse)."""
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def _joined(events: list[dict], kind: str) -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind)


def test_responses_reasoning_item_is_the_split_streamed_and_not(servers):
    """No guided fields on this route, so the tiny model writes no tags: the parsers read it
    all as thinking (the template opened the block). The oracle: the parser's split (held
    to vLLM's above) of the no-parser server's reply."""
    import openai

    from tests.test_responses_api import check_event_order

    body = {"model": "tiny-random-llama", "input": "Think, then answer.", "temperature": 0,
            "max_output_tokens": 16, "reasoning": {"effort": "low", "summary": "auto"}}
    plain = openai.OpenAI(base_url=servers.plain + "/v1", api_key="x").responses.create(**body)
    assert [i.type for i in plain.output] == ["message"]
    for name in ("deepseek_r1", "qwen3"):
        thought, content = reasoning_parser(name).split(plain.output_text)
        assert thought, plain.output_text
        client = openai.OpenAI(base_url=getattr(servers, name) + "/v1", api_key="x")
        resp = client.responses.create(**body)
        assert resp.reasoning.effort == "low"
        assert [i.type for i in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == thought and resp.output_text == content
        events = _sse(servers, getattr(servers, name), body)
        check_event_order(events)
        assert _joined(events, "response.reasoning_text.delta") == thought
        assert _joined(events, "response.output_text.delta") == content
        raw = servers.http.post(getattr(servers, name) + "/v1/responses", json=body).json()["output"]
        assert _no_ids(events[-1]["response"]["output"]) == _no_ids(raw)
        streamed = list(client.responses.create(**body, stream=True))     # the client's event types
        deltas = "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta")
        got = streamed[-1].response
        assert deltas == got.output[0].content[0].text == thought and got.output_text == content


@pytest.mark.parametrize("bad_reasoning, param", [
    ("high", "reasoning"), ({"effort": "max"}, "reasoning.effort"), ({"summary": 3}, "reasoning.summary")])
def test_responses_bad_reasoning_is_a_400_naming_the_field(servers, bad_reasoning, param):
    r = servers.http.post(servers.qwen3 + "/v1/responses",
                          json={"model": "tiny-random-llama", "input": "hi", "reasoning": bad_reasoning})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_stream_of_any_cut_is_the_whole_reply():
    """Thinking, then text or a tool call, cut at random: the streamed items, read back by
    the documented events, are the response's, reasoning first (unit: over outputs)."""
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.sampling_params import SamplingParams
    from serving.request import GenRequest
    from serving.responses_request import ResponsesCall
    from serving.responses_response import ResponsesStream, output_items
    from serving.responses_store import ResponseStore
    from serving.tools import ToolSpec
    from tests.test_responses_api import check_event_order

    spec = ToolSpec(({"name": "get_weather", "description": "", "parameters": {}},), "auto")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    texts = ["<think>hm, rain?</think>Take a coat.", "<think>hm</think>" + call, "still thinking </thi",
             "no end tag at all", "<think>a</think>", "</think>only an answer", "<think>x</think>a " + call]
    rng = random.Random(11)
    for seed in range(200):
        text, name = texts[seed % len(texts)], ("deepseek_r1", "qwen3")[seed % 2]
        api = ResponsesCall("resp_x", {}, (), False, True)
        req = GenRequest("responses", "m", [1, 2], "", SamplingParams(), stream=True, tools=spec, api=api,
                         reasoning=reasoning_parser(name))
        out = lambda n, fin: RequestOutput("r", None, [1, 2], [CompletionOutput(0, text[:n], list(range(n)), fin, None)],
                                           finished=fin is not None)
        s, chunks, n = ResponsesStream(req, ResponseStore()), [], 0
        while n < len(text):
            n = min(len(text), n + rng.randint(1, 6))
            chunks += s.events(out(n, None))
        chunks += s.end(out(len(text), "stop"))
        events = [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]
        check_event_order(events)
        want = output_items(req, text, "completed")
        assert _no_ids(events[-1]["response"]["output"]) == _no_ids(want)
        items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert _no_ids(items) == _no_ids(want) and items[0]["id"] == want[0]["id"], (seed, text)
        thought = _joined(events, "response.reasoning_text.delta")
        assert thought == (want[0]["content"][0]["text"] if want[0]["type"] == "reasoning" else ""), (seed, text)
        msg = [i for i in want if i["type"] == "message"]
        assert _joined(events, "response.output_text.delta") == (msg[0]["content"][0]["text"] if msg else "")

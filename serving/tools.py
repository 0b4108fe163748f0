"""OpenAI tool calling on the chat route: ``tools`` / ``tool_choice`` in, ``tool_calls`` out
(the Anthropic and Responses parsers build the same ToolSpec from their own shapes).

Format: the Hermes / Qwen one, which SmolLM2's instruct data and Qwen2.5 / Qwen3 use: the
model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several blocks
for several calls; SmolLM2 may also put a JSON array of calls in one block). A chat
template that knows tools (Qwen's: it reads ``tools``) renders them itself; for one that
does not (SmolLM2's GGUF template) the tools go into a system message in the same format.

``tool_choice``: ``none`` (tools not shown, no parsing), ``auto`` (the model decides; the
reply is parsed), ``required`` or a named function: the output is constrained to one
``<tool_call>`` block whose JSON matches one of the allowed tools' parameter schemas
(a Lark grammar with an embedded JSON schema, compiled by llguidance like any grammar).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jaxinfer.engine.guided import JSON_OPTIONS
from serving.errors import bad
from serving.fields import type_name

MAX_TOOLS = 64
MAX_TOOLS_CHARS = 64 * 1024        # the tools' JSON, all together
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The request's tools (OpenAI ``function`` objects) and the choice."""

    functions: tuple[dict, ...]
    choice: str                      # "auto" | "required" | "named"
    named: str | None = None

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def parse_tools(body: dict) -> ToolSpec | None:
    """``tools`` and ``tool_choice`` of a chat body -> ToolSpec, or None (no tools, or
    ``tool_choice: none``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "needs tools")
        return None
    check_tool_list(tools)
    fns = []
    for i, t in enumerate(tools):
        name = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(name, "must be {\"type\": \"function\", \"function\": {...}}")
        fns.append(function_dict(t["function"], f"{name}.function.", "parameters"))
    if choice in (None, "auto"):
        return tool_spec(fns, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return tool_spec(fns, "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return tool_spec(fns, "named", choice["function"].get("name"))
    raise bad("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", "
              "\"function\": {\"name\": ...}}")


def check_tool_list(tools: Any) -> None:
    """The bounds every API's ``tools`` array is held to."""
    if not isinstance(tools, list):
        raise bad("tools", f"must be an array of tool objects, got {type_name(tools)}")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise bad("tools", f"the tools' JSON is over the limit of {MAX_TOOLS_CHARS} characters")


def function_dict(fn: dict, prefix: str, schema_key: str) -> dict:
    """One tool's name, description and parameter schema (read from ``schema_key``:
    OpenAI's ``parameters``, Anthropic's ``input_schema``) -> the function dict a ToolSpec
    holds; errors name ``prefix`` + the field."""
    if not isinstance(fn.get("name"), str) or not FUNCTION_NAME.match(fn["name"]):
        raise bad(f"{prefix}name", "must be 1-64 letters, digits, '_', '-' or '.'")
    params = fn.get(schema_key, {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad(f"{prefix}{schema_key}", f"must be a JSON schema object, got {type_name(params)}")
    desc = fn.get("description", "")
    if desc is None:
        desc = ""
    if not isinstance(desc, str):
        raise bad(f"{prefix}description", "must be a string")
    return {"name": fn["name"], "description": desc, "parameters": params}


def tool_spec(fns: list[dict], choice: str, named: Any = None) -> ToolSpec:
    """The checked functions and choice ("auto" | "required" | "named") -> ToolSpec."""
    if len({f["name"] for f in fns}) != len(fns):
        raise bad("tools", "function names must be unique")
    if choice == "named" and named not in {f["name"] for f in fns}:
        raise bad("tool_choice", f"names a function that is not in tools: {named!r:.64}")
    return ToolSpec(tuple(fns), choice, named if choice == "named" else None)


def call_grammar(spec: ToolSpec) -> dict:
    """``SamplingParams.guided`` for required / named: one <tool_call> block of an allowed tool."""
    fns = [f for f in spec.functions if spec.choice != "named" or f["name"] == spec.named]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                           "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in fns],
              "x-guidance": JSON_OPTIONS}
    return {"grammar": f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}'}


def system_prompt(spec: ToolSpec) -> str:
    """The tools for a template that cannot render them (Hermes / SmolLM2 wording)."""
    tools = "\n".join(json.dumps({"type": "function", "function": f}) for f in spec.functions)
    return ("You are a function calling AI model. You may call one or more functions to assist with "
            "the user query. Here are the available tools:\n<tools>\n" + tools + "\n</tools>\n"
            "For each function call, return a json object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def render_messages(messages: list[dict], spec: ToolSpec, tokenizer: Any,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids with the tools shown: by the template when it reads ``tools``, else as a
    system message (merged with the conversation's own system message, if any).
    ``template_kwargs``: the request's chat_template_kwargs."""
    template = tokenizer.chat_template or ""
    if "tools" in template:
        tools = [{"type": "function", "function": f} for f in spec.functions]
        text = tokenizer.render_chat(messages, add_generation_prompt=True, template_kwargs=template_kwargs,
                                     tools=tools)
        return tokenizer.encode(text, add_special_tokens=False)
    sys_text = system_prompt(spec)
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + sys_text}] + messages[1:]
    else:
        messages = [{"role": "system", "content": sys_text}] + messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, template_kwargs=template_kwargs)


def assistant_calls_text(calls: Any, name: str) -> str:
    """An assistant message's ``tool_calls`` written back in the model's format (for the
    next turn's prompt)."""
    if not isinstance(calls, list):
        raise bad(name, f"must be an array, got {type_name(calls)}")
    blocks = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{name}[{i}].function", "must be an object with a name")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise bad(f"{name}[{i}].function.arguments", "must be a JSON object (as text)") from None
        blocks.append((fn["name"], args))
    return calls_text(blocks)


def calls_text(calls: list[tuple[str, Any]]) -> str:
    """(name, arguments) pairs in the model's format: one ``<tool_call>`` block each."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
                     for n, a in calls)


def with_calls(content: str, calls: str) -> str:
    """An assistant turn's text followed by its calls, as the next prompt shows them."""
    return f"{content}\n{calls}" if content else calls


def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, tool_calls in OpenAI's shape). Blocks that are not
    JSON objects with a known function name are left in the content."""
    known = {f["name"] for f in spec.functions}
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        items = obj if isinstance(obj, list) else [obj]
        if not all(isinstance(o, dict) and o.get("name") in known and isinstance(o.get("arguments", {}), dict)
                   for o in items):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        for o in items:
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": o["name"], "arguments": json.dumps(o.get("arguments", {}))}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def hold_tool_text(held: str, new: str, spec: ToolSpec) -> tuple[str, str]:
    """(text that can stream now, text to hold) for a reply that may turn into tool calls.
    With ``auto`` the text streams up to where a ``<tool_call>`` begins (a tail that could
    be the start of the tag is held back); from the tag on (and for required / named, from
    the start) it is held until the reply ends, then parsed (``parse_tool_calls``)."""
    held += new
    if spec.constrained:
        return "", held
    cut = _safe_prefix(held)
    return held[:cut], held[cut:]


def stream_tool_deltas(streamer: Any, d: Any) -> list[dict]:
    """Chat stream choices for a request with tools (``hold_tool_text``; the held text is in
    ``streamer.held``). When the choice ends its tool calls go out as OpenAI sends them
    (one delta with the call's id, type and name, one with its arguments) with
    ``finish_reason: "tool_calls"``, or, if it parses as none, the held text as content."""
    spec: ToolSpec = streamer.req.tools
    now, held = hold_tool_text(streamer.held.get(d.index, ""), d.text, spec)
    out = []
    if now:
        out.append({"index": d.index, "delta": {"content": now}, "logprobs": None, "finish_reason": None})
    streamer.held[d.index] = held
    if d.finish_reason is None:
        return out
    content, calls = parse_tool_calls(streamer.held.pop(d.index), spec)
    if content:
        out.append({"index": d.index, "delta": {"content": content}, "logprobs": None, "finish_reason": None})
    for i, c in enumerate(calls):
        fn = c["function"]
        out.append({"index": d.index, "delta": {"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}}]}, "logprobs": None, "finish_reason": None})
        out.append({"index": d.index, "delta": {"tool_calls": [{"index": i, "function": {
                    "arguments": fn["arguments"]}}]}, "logprobs": None, "finish_reason": None})
    out.append({"index": d.index, "delta": {}, "logprobs": None,
                "finish_reason": "tool_calls" if calls else d.finish_reason, "stop_reason": d.stop_reason})
    return out


_TAG = "<tool_call>"


def _safe_prefix(text: str) -> int:
    """How much of ``text`` can stream as content: all of it up to a ``<tool_call>`` tag, or
    up to a tail that may still grow into one."""
    i = text.find(_TAG)
    if i >= 0:
        return i
    for k in range(min(len(_TAG) - 1, len(text)), 0, -1):
        if _TAG.startswith(text[-k:]):
            return len(text) - k
    return len(text)

"""OpenAI Responses API ``POST /v1/responses`` bodies -> ``GenRequest`` (kind "responses").

The conversation (``previous_response_id``'s stored items, then ``input``'s) becomes chat
messages in the shape ``/v1/chat/completions`` takes (``function_call`` items become an
assistant message's ``tool_calls``, ``function_call_output`` items ``tool`` messages) and
goes through the chat route's own conversion (serving/openai_request.py ``openai_messages``)
and rendering (serving/request.py ``chat_prompt_ids``): one conversation is one prompt by
either route, so greedy text is the same. Tools (the flat Responses shape, checked by
serving/tools.py's shared helpers into the chat route's ToolSpec), ``text.format``
(serving/guided_protocol.py) and the sampling fields map onto what the chat route uses.

Bounds: ``MAX_INPUT_ITEMS`` items per request, ``MAX_CONVERSATION_ITEMS`` with the previous
turns', ``MAX_PARTS`` content parts per message, ``MAX_TEXT_CHARS`` per text, ids of
``MAX_ID_CHARS``, and ``metadata`` as OpenAI documents it (16 keys of 64 characters, values
of 512); the body's size limit (serving/app.py) bounds the rest.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving import tools as T
from serving.errors import ProtocolError, bad
from serving.fields import Fields, Limits, objects, short, type_name
from serving.fields import text as checked_text
from serving.guided_protocol import format_constraint
from serving.openai_request import openai_messages, tool_constraint
from serving.reasoning import reasoning_parser
from serving.request import GenRequest, chat_prompt_ids, check_model, resolve_max_tokens, sampling_params
from serving.responses_store import ResponseStore

MAX_INPUT_ITEMS = 1024
MAX_CONVERSATION_ITEMS = 4096
MAX_PARTS = 64
MAX_ID_CHARS = 128
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_USER_CHARS = 256
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# ``include`` values about items this server never produces: accepted, nothing to add.
# Output logprobs are not offered on this route yet: asking for them is a 400.
INCLUDE_NOTHING = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                   "web_search_call.action.sources", "message.input_image.image_url",
                   "computer_call_output.output.image_url", "code_interpreter_call.outputs")
INCLUDE_UNSUPPORTED = ("message.output_text.logprobs",)


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """What the response object needs beyond the ``GenRequest`` (``GenRequest.api``)."""

    id: str                          # "resp_..."
    echo: dict                       # the request's settings, as the response object repeats them
    conversation: tuple[dict, ...]   # the previous turns' items and this input's, normalised
    store: bool
    parallel_tool_calls: bool


def parse_responses_request(body: dict, limits: Limits, tokenizer: Any, store: ResponseStore) -> GenRequest:
    f = Fields(body)
    model = check_model(f, limits)
    _reject_unsupported(f)
    spec = parse_tools(body)
    prev_id = f.str("previous_response_id")
    conversation = _previous(prev_id, store) + input_items(body.get("input"))
    if len(conversation) > MAX_CONVERSATION_ITEMS:
        raise bad("input", f"with the previous turns the conversation has {len(conversation)} items; "
                  f"at most {MAX_CONVERSATION_ITEMS}")
    instructions = _text_field(f, "instructions")
    messages = openai_messages(items_to_chat(conversation))
    if instructions:       # OpenAI: a previous turn's instructions are not carried over
        messages = [{"role": "system", "content": instructions}] + messages
    temperature, top_p = f.num("temperature", 1.0), f.num("top_p", 1.0)
    sampling: dict[str, Any] = dict(temperature=temperature, top_p=top_p)
    fmt = _text_format(f)
    if fmt is not None:
        guided = format_constraint(fmt, "text.format", flat=True)
        if guided is not None:
            sampling["guided"] = guided
    tool_constraint(sampling, spec, "text.format")
    ids = chat_prompt_ids(messages, spec, tokenizer, param="input")
    max_out = f.int("max_output_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"])
    sampling["max_tokens"] = resolve_max_tokens(max_out, None, len(ids), limits, "max_output_tokens", "input")
    params = sampling_params({"max_tokens": "max_output_tokens"}, **sampling)
    stream, keep = f.bool("stream", False), f.bool("store", True)
    if f.get("stream_options") is not None and not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    f.obj("stream_options")
    parallel = f.bool("parallel_tool_calls", True)
    echo = dict(instructions=instructions, metadata=_metadata(f), parallel_tool_calls=parallel,
                previous_response_id=prev_id, store=keep, temperature=temperature, top_p=top_p,
                max_output_tokens=max_out, text={"format": fmt or {"type": "text"}}, truncation="disabled",
                tool_choice=body.get("tool_choice") or "auto", tools=_tools_echo(body.get("tools")),
                user=_user(f), reasoning=_reasoning(f), service_tier="default", top_logprobs=0)
    call = ResponsesCall("resp_" + uuid.uuid4().hex, echo, tuple(conversation), keep, parallel)
    return GenRequest("responses", model, ids, "", params, stream=stream, tools=spec, api=call,
                      reasoning=reasoning_parser(limits.reasoning_parser))


def parse_tools(body: dict) -> T.ToolSpec | None:
    """Responses ``tools`` (``{"type": "function", "name", "description", "parameters",
    "strict"}``) and ``tool_choice`` -> the chat route's ToolSpec, or None (no tools, or
    ``none``: the tools are not shown)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "needs tools")
        return None
    T.check_tool_list(tools)
    fns = []
    for name, t in objects(tools, "tools", T.MAX_TOOLS, "a tool object"):
        if t.get("type") != "function":
            raise bad(f"{name}.type", f"only 'function' tools are supported, got {short(t.get('type'), 40)}",
                      code="unsupported")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"{name}.strict", f"must be a boolean, got {type_name(t['strict'])}")
        # OpenAI's parameters is required but nullable: null is "no parameters"
        fn = {k: v for k, v in t.items() if not (k == "parameters" and v is None)}
        fns.append(T.function_dict(fn, f"{name}.", "parameters"))
    if choice in (None, "auto", "required"):
        return T.tool_spec(fns, choice or "auto")
    if choice == "none":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function":
        return T.tool_spec(fns, "named", choice.get("name"))
    raise bad("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _reject_unsupported(f: Fields) -> None:
    for key, why in (("background", "background responses"), ("conversation", "stored conversations "
                     "(use previous_response_id)"), ("prompt", "prompt templates"),
                     ("max_tool_calls", "a cap on tool calls")):
        f.reject_if_set(key, why)
    f.reject_if_set("top_logprobs", "logprobs on /v1/responses", allowed=(0,))
    f.reject_if_set("truncation", "truncation (only 'disabled')", allowed=("disabled",))
    f.reject_if_set("service_tier", "service tiers", allowed=("auto", "default"))
    f.str("prompt_cache_key")
    inc = f.get("include")
    if inc is None:
        return
    if not isinstance(inc, list) or len(inc) > 16:
        raise bad("include", "must be an array of at most 16 strings")
    for i, v in enumerate(inc):
        if v in INCLUDE_UNSUPPORTED:
            raise bad(f"include[{i}]", f"{v!r} is not supported yet", code="unsupported")
        if v not in INCLUDE_NOTHING:
            raise bad(f"include[{i}]", f"unknown value {short(v, 60)}")


def _previous(prev_id: str | None, store: ResponseStore) -> list[dict]:
    if prev_id is None:
        return []
    entry = store.get(prev_id) if len(prev_id) <= MAX_ID_CHARS else None
    if entry is None:
        raise ProtocolError(f"previous_response_id: no stored response with id {short(prev_id, 60)} "
                            "(never stored, expired, evicted or deleted)", param="previous_response_id",
                            status=404, code="previous_response_not_found", err_type="invalid_request_error")
    return list(entry.conversation)


def _text_field(f: Fields, key: str) -> str | None:
    v = f.get(key)
    return None if v is None else checked_text(v, f.name(key))


def input_items(v: Any) -> list[dict]:
    """``input`` -> normalised items (a string is one user message)."""
    if v is None:
        raise bad("input", "is required")
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": checked_text(v, "input")}]
    if not isinstance(v, list):
        raise bad("input", f"must be a string or an array of input items, got {type_name(v)}")
    if not v:
        raise bad("input", "must contain at least one item")
    if len(v) > MAX_INPUT_ITEMS:
        raise bad("input", f"at most {MAX_INPUT_ITEMS} items, got {len(v)}")
    return [_item(x, f"input[{i}]") for i, x in enumerate(v)]


def _item(x: Any, name: str) -> dict:
    if not isinstance(x, dict):
        raise bad(name, f"must be an object, got {type_name(x)}")
    kind = x.get("type", "message" if "role" in x else None)
    if kind == "message":
        return _message(x, name)
    if kind == "function_call":
        return {"type": "function_call", "call_id": _call_id(x, name), "name": _function_name(x, name),
                "arguments": _arguments(x, name)}
    if kind == "function_call_output":
        out = x.get("output")
        text = checked_text(out, f"{name}.output") if isinstance(out, str) or out is None \
            else _parts(out, f"{name}.output")
        return {"type": "function_call_output", "call_id": _call_id(x, name), "output": text}
    if kind is None:
        raise bad(f"{name}.type", "is required (message, function_call or function_call_output)")
    raise bad(f"{name}.type", f"{short(kind, 40)} items are not supported (message, function_call, "
              "function_call_output)", code="unsupported")


def _message(x: dict, name: str) -> dict:
    role = x.get("role")
    if role not in ROLES:
        raise bad(f"{name}.role", f"must be one of {', '.join(ROLES)}, got {short(role, 40)}")
    content = x.get("content")
    if isinstance(content, str):
        content = checked_text(content, f"{name}.content")
    else:
        content = _parts(content, f"{name}.content")
    return {"type": "message", "role": role, "content": content}


def _parts(parts: Any, name: str) -> list[dict]:
    if not isinstance(parts, list):
        raise bad(name, f"must be a string or an array of content parts, got {type_name(parts)}")
    out = []
    for pname, p in objects(parts, name, MAX_PARTS, "a content part object"):
        kind = p.get("type")
        if kind in MEDIA_PARTS:
            raise bad(f"{pname}.type", f"{kind!r} content is not supported yet (text only)", code="unsupported")
        if kind not in TEXT_PARTS:
            raise bad(f"{pname}.type", f"must be one of {', '.join(TEXT_PARTS)}, got {short(kind, 40)}")
        out.append({"type": kind, "text": checked_text(p.get("text"), f"{pname}.text")})
    return out


def _call_id(x: dict, name: str) -> str:
    v = x.get("call_id")
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_ID_CHARS:
        raise bad(f"{name}.call_id", f"must be a string of 1-{MAX_ID_CHARS} characters")
    return v


def _function_name(x: dict, name: str) -> str:
    v = x.get("name")
    if not isinstance(v, str) or not T.FUNCTION_NAME.match(v):
        raise bad(f"{name}.name", "must be 1-64 letters, digits, '_', '-' or '.'")
    return v


def _arguments(x: dict, name: str) -> str:
    v = checked_text(x.get("arguments"), f"{name}.arguments")
    try:
        ok = isinstance(json.loads(v), dict)
    except ValueError:
        ok = False
    if not ok:
        raise bad(f"{name}.arguments", "must be a JSON object, as text")
    return v


def items_to_chat(items: list[dict]) -> list[dict]:
    """Normalised items -> chat completions ``messages``: a function_call joins the assistant
    message before it (or starts one) as a ``tool_calls`` entry, as a chat client sends it."""
    out: list[dict] = []
    for it in items:
        if it["type"] == "message":
            c = it["content"]
            out.append({"role": it["role"], "content": c if isinstance(c, str)
                        else [{"type": "text", "text": p["text"]} for p in c]})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = out[-1].get("tool_calls", []) + [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            o = it["output"]
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": o if isinstance(o, str)
                        else [{"type": "text", "text": p["text"]} for p in o]})
    return out


def _text_format(f: Fields) -> dict | None:
    text = f.obj("text")
    if text is None:
        return None
    t = Fields(text, "text.")
    t.str("verbosity")
    fmt = t.obj("format")
    if fmt is not None and fmt.get("name") is not None and not isinstance(fmt["name"], str):
        raise bad("text.format.name", f"must be a string, got {type_name(fmt['name'])}")
    return fmt


def _reasoning(f: Fields) -> dict | None:
    """``reasoning``: checked and echoed, otherwise ignored (as vLLM does for a model that
    is not gpt-oss): the model thinks as its template and ``--reasoning-parser`` say."""
    r = f.obj("reasoning")
    if r is None:
        return None
    g = Fields(r, "reasoning.")
    effort, summary = g.str("effort"), g.str("summary")
    if effort not in (None, "minimal", "low", "medium", "high"):
        raise bad("reasoning.effort", f"must be 'minimal', 'low', 'medium' or 'high', got {short(effort, 40)}")
    if summary not in (None, "auto", "concise", "detailed"):
        raise bad("reasoning.summary", f"must be 'auto', 'concise' or 'detailed', got {short(summary, 40)}")
    return {"effort": effort, "summary": summary}


def _metadata(f: Fields) -> dict[str, str]:
    md = f.obj("metadata") or {}
    if len(md) > MAX_METADATA_KEYS:
        raise bad("metadata", f"at most {MAX_METADATA_KEYS} keys, got {len(md)}")
    for k, v in md.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise bad("metadata", f"keys are at most {MAX_METADATA_KEY_CHARS} characters: {short(k, 40)}")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
            raise bad(f"metadata.{k}", f"must be a string of at most {MAX_METADATA_VALUE_CHARS} characters")
    return dict(md)


def _user(f: Fields) -> str | None:
    u = f.str("user")
    if u is not None and len(u) > MAX_USER_CHARS:
        raise bad("user", f"at most {MAX_USER_CHARS} characters")
    return u


def _tools_echo(tools: Any) -> list[dict]:
    """The tools as the response object lists them (already checked by parse_tools)."""
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools or []]

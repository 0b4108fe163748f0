"""Anthropic Messages API bodies (``/v1/messages``, ``/v1/messages/count_tokens``) ->
``GenRequest`` / a token count.

The conversation becomes the same chat-template messages /v1/chat/completions builds for
the equivalent OpenAI conversation, so prompt ids (and greedy replies) are the same:
``system`` (a string or text blocks) a system message; text blocks joined by newlines as
OpenAI text parts are; an assistant's ``tool_use`` blocks its ``<tool_call>`` text
(serving/tools.py, as an OpenAI ``tool_calls`` entry is written back); each
``tool_result`` block a ``tool`` role message (as OpenAI's ``tool`` messages). ``tools``
(name, description, input_schema) and ``tool_choice`` (auto, any, tool, none) become the
ToolSpec the chat route uses (any: required, tool: named).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving import tools as T
from serving.errors import bad
from serving.fields import Fields, Limits, objects, short, type_name
from serving.fields import MAX_TEXT_CHARS, text as checked_text  # noqa: F401 - MAX_TEXT_CHARS: openapi.py reads it here
from serving.reasoning import reasoning_parser
from serving.request import (GenRequest, chat_prompt_ids, check_model, resolve_max_tokens,
                             sampling_params)

MAX_MESSAGES = 4096
MAX_BLOCKS = 512               # content blocks per message, in system, in one tool_result
MAX_ID_CHARS = 256             # tool_use ids, metadata.user_id
ROLES = ("user", "assistant")
_UNSUPPORTED = {"image": "image input", "document": "document input", "search_result": "search results",
                "server_tool_use": "server tools", "web_search_tool_result": "server tools"}
_CHOICES = {"auto": "auto", "any": "required", "tool": "named"}
# An earlier turn's thinking, sent back as clients do: dropped, as Anthropic drops it from
# the context (and Qwen3's template strips it from history).
_THINKING_BLOCKS = ("thinking", "redacted_thinking")


def parse_messages_request(body: dict, limits: Limits, tokenizer: Any) -> GenRequest:
    f = Fields(body)
    model = _model(f, limits)
    max_tokens = f.int("max_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"])
    if max_tokens is None:
        raise bad("max_tokens", "is required")
    template_kwargs = _thinking(f)
    ids, spec = _prompt(body, tokenizer, template_kwargs)
    _metadata(f)
    sampling: dict[str, Any] = dict(
        temperature=f.num("temperature", 1.0), top_p=f.num("top_p", 1.0),
        top_k=f.top_k("top_k", 0, limits, lo=0), stop=_stop_sequences(f))
    if spec is not None and spec.constrained:
        sampling["guided"] = T.call_grammar(spec)
    # max_tokens is a ceiling: a reply stops at the context length (stop_reason max_tokens)
    # rather than the request failing, as llama.cpp and vLLM treat Claude Code's large ones.
    sampling["max_tokens"] = resolve_max_tokens(None, max_tokens, len(ids), limits, "max_tokens", "messages")
    params = sampling_params({"stop": "stop_sequences"}, **sampling)
    return GenRequest("messages", model, ids, "", params, stream=f.bool("stream", False), tools=spec,
                      reasoning=reasoning_parser(limits.reasoning_parser, template_kwargs))


def _thinking(f: Fields) -> dict[str, Any]:
    """``thinking: {"type": "disabled"}`` -> the chat template's and the reasoning parser's
    ``enable_thinking: false`` (Qwen3's switch); enabled or absent: the model's default."""
    t = f.obj("thinking")
    if t is None:
        return {}
    kind = t.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {short(kind)}")
    return {"enable_thinking": False} if kind == "disabled" else {}


def count_tokens(body: dict, limits: Limits, tokenizer: Any) -> dict:
    """``/v1/messages/count_tokens``: the prompt's length for the same body (no max_tokens)."""
    _model(Fields(body), limits)
    ids, _ = _prompt(body, tokenizer, _thinking(Fields(body)))
    return {"input_tokens": len(ids)}


def _model(f: Fields, limits: Limits) -> str:
    if f.get("model") is None:
        raise bad("model", "is required")
    return check_model(f, limits)


def _prompt(body: dict, tokenizer: Any, template_kwargs: dict[str, Any] | None = None
            ) -> tuple[list[int], T.ToolSpec | None]:
    spec = parse_tools(body)
    messages = _system(body.get("system")) + chat_messages(body.get("messages"))
    return chat_prompt_ids(messages, spec, tokenizer, template_kwargs=template_kwargs), spec


def _stop_sequences(f: Fields) -> tuple[str, ...]:
    v = f.get("stop_sequences")
    if v is not None and not isinstance(v, list):
        raise bad("stop_sequences", f"must be an array of strings, got {type_name(v)}")
    return f.stop("stop_sequences")


def _metadata(f: Fields) -> None:
    meta = f.obj("metadata")
    if meta is not None:
        user = Fields(meta, "metadata.").str("user_id")
        if user is not None and len(user) > MAX_ID_CHARS:
            raise bad("metadata.user_id", f"must be at most {MAX_ID_CHARS} characters")


# ------------------------------------------------------------------ tools

def parse_tools(body: dict) -> T.ToolSpec | None:
    """Anthropic ``tools`` / ``tool_choice`` -> the chat route's ToolSpec, or None (no tools,
    or tool_choice none: the tools are not shown, as on the chat route)."""
    tools, choice = body.get("tools"), _choice(body.get("tool_choice"))
    if tools is None or tools == []:
        if choice[0] in ("required", "named"):
            raise bad("tool_choice", "needs tools")
        return None
    T.check_tool_list(tools)
    fns = []
    for name, t in objects(tools, "tools", T.MAX_TOOLS, "a tool object"):
        if t.get("type") not in (None, "custom"):
            raise bad(f"{name}.type", f"server tools ({short(t.get('type'))}) are not supported; "
                      "only client tools with name, description and input_schema", code="unsupported")
        fns.append(T.function_dict(t, f"{name}.", "input_schema"))
    if choice[0] == "none":
        return None
    return T.tool_spec(fns, *choice)


def _choice(c: Any) -> tuple[str, str | None]:
    if c is None:
        return "auto", None
    if not isinstance(c, dict) or c.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice", "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    Fields(c, "tool_choice.").bool("disable_parallel_tool_use", False)
    if c["type"] == "none":
        return "none", None
    if c["type"] == "tool" and not isinstance(c.get("name"), str):
        raise bad("tool_choice.name", "is required with type 'tool' and must be a string")
    return _CHOICES[c["type"]], c.get("name") if c["type"] == "tool" else None


# ------------------------------------------------------------------ conversation

def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": checked_text(system, "system")}] if system else []
    if not isinstance(system, list):
        raise bad("system", f"must be a string or an array of text blocks, got {type_name(system)}")
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if system else []


def chat_messages(msgs: Any) -> list[dict]:
    """Anthropic ``messages`` -> chat-template messages (see the module docstring)."""
    out: list[dict] = []
    for name, m in objects(msgs, "messages", MAX_MESSAGES, "a message object", required="message"):
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{name}.role", f"must be 'user' or 'assistant', got {short(role)}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": checked_text(content, f"{name}.content")})
        elif isinstance(content, list):
            out.extend((_assistant if role == "assistant" else _user)(_blocks(content, f"{name}.content"),
                                                                     f"{name}.content"))
        else:
            raise bad(f"{name}.content", f"must be a string or an array of content blocks, got {type_name(content)}")
    return out


def _blocks(blocks: list, name: str) -> list[tuple[str, dict]]:
    """(field name, block) of each block, its type checked."""
    out = []
    for bname, b in objects(blocks, name, MAX_BLOCKS, "a content block object"):
        kind = b.get("type")
        if kind in _THINKING_BLOCKS:
            continue
        if kind in _UNSUPPORTED:
            raise bad(f"{bname}.type", f"{_UNSUPPORTED[kind]} ({kind!r}) is not supported yet", code="unsupported")
        if kind not in ("text", "tool_use", "tool_result"):
            raise bad(f"{bname}.type", f"unknown content block type {short(kind)}; expected "
                      "'text', 'tool_use' or 'tool_result'")
        out.append((bname, b))
    return out


def _user(blocks: list[tuple[str, dict]], name: str) -> list[dict]:
    """A user turn: its text blocks as user messages, each tool_result a ``tool`` message,
    in the order they came."""
    out: list[dict] = []
    texts: list[str] = []
    for bname, b in blocks:
        if b["type"] == "tool_use":
            raise bad(f"{bname}.type", "tool_use blocks belong in assistant messages")
        if b["type"] == "text":
            texts.append(checked_text(b.get("text"), f"{bname}.text"))
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        out.append({"role": "tool", "content": _tool_result(b, bname)})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(b: dict, name: str) -> str:
    f = Fields(b, f"{name}.")
    _id(f, "tool_use_id")
    f.bool("is_error", False)
    content = b.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return checked_text(content, f"{name}.content")
    if not isinstance(content, list):
        raise bad(f"{name}.content", f"must be a string or an array of text blocks, got {type_name(content)}")
    return _text_blocks(content, f"{name}.content")


def _assistant(blocks: list[tuple[str, dict]], name: str) -> list[dict]:
    """An assistant turn: its text, then its tool_use blocks as the model writes calls."""
    texts, calls = [], []
    for bname, b in blocks:
        if b["type"] == "tool_result":
            raise bad(f"{bname}.type", "tool_result blocks belong in user messages")
        if b["type"] == "text":
            texts.append(checked_text(b.get("text"), f"{bname}.text"))
            continue
        f = Fields(b, f"{bname}.")
        _id(f, "id")
        tool = f.str("name")
        if tool is None or not tool or len(tool) > MAX_ID_CHARS:
            raise bad(f"{bname}.name", f"is required: a string of 1-{MAX_ID_CHARS} characters")
        args = f.obj("input")
        calls.append((tool, {} if args is None else args))
    content = "\n".join(texts)
    return [{"role": "assistant", "content": T.with_calls(content, T.calls_text(calls)) if calls else content}]


def _text_blocks(blocks: list, name: str) -> str:
    texts = []
    for bname, b in objects(blocks, name, MAX_BLOCKS, "a text block object"):
        if b.get("type") != "text":
            kind = b.get("type")
            what = _UNSUPPORTED.get(kind) if isinstance(kind, str) else None
            raise bad(f"{bname}.type", f"{what} ({kind!r}) is not supported yet" if what else
                      f"only 'text' blocks are allowed here, got {short(kind)}", code="unsupported")
        texts.append(checked_text(b.get("text"), f"{bname}.text"))
    return "\n".join(texts)


def _id(f: Fields, key: str) -> str:
    v = f.str(key)
    if v is None or not v or len(v) > MAX_ID_CHARS:
        raise bad(f.name(key), f"is required: a string of 1-{MAX_ID_CHARS} characters")
    return v

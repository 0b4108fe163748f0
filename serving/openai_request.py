"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies (with vLLM's extra
fields) -> ``GenRequest``."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.bounds import PRIORITY
from jaxinfer.sampling_params import SamplingParams
from serving.errors import bad
from serving.fields import (MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN, Fields, check_token_ids, objects,
                            Limits, is_int, short, type_name)
from serving import tools as T
from serving.guided_protocol import openai_constraints
from serving.reasoning import reasoning_parser
from serving.scoring_request import openai_search, watermark
from serving.request import (GenRequest, chat_prompt_ids, check_model, decode_ids, encode_text,
                             resolve_max_tokens, sampling_params)


DEFAULT_COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096       # messages in one conversation (the body limit bounds them too)
MAX_PARTS = 512           # content parts in one message


def _common_sampling(f: Fields, limits: Limits) -> dict[str, Any]:
    """The sampling fields shared by /v1/completions and /v1/chat/completions (incl. vLLM's)."""
    n = f.int("n", 1, bound=SamplingParams.BOUNDS["n"])
    if n > limits.max_n:
        raise bad("n", f"must be <= {limits.max_n} on this server, got {n}")
    wm = watermark(f)
    return dict(openai_constraints(f, limits), **({} if wm is None else {"watermark": wm}),
        n=n,
        temperature=f.num("temperature", 1.0),
        top_p=f.num("top_p", 1.0),
        top_k=f.top_k("top_k", 0, limits),
        min_p=f.num("min_p", 0.0),
        presence_penalty=f.num("presence_penalty", 0.0),
        frequency_penalty=f.num("frequency_penalty", 0.0),
        repetition_penalty=f.num("repetition_penalty", 1.0),
        seed=f.int("seed", None, lo=SEED_MIN, hi=SEED_MAX),
        stop=f.stop("stop"),
        stop_token_ids=f.token_ids("stop_token_ids", limits, MAX_STOP_TOKEN_IDS),
        ignore_eos=f.bool("ignore_eos", False),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        cache_salt=f.str("cache_salt", None),
    )


def _stream_flags(f: Fields) -> dict[str, bool]:
    """stream, include_usage and continuous_usage (vLLM: usage in every chunk, only with
    include_usage)."""
    stream = f.bool("stream", False)
    opts = f.obj("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        o = Fields(opts, "stream_options.")
        include_usage = o.bool("include_usage", False)
        continuous = o.bool("continuous_usage_stats", False) and include_usage
    return dict(stream=stream, include_usage=include_usage, continuous_usage=continuous)


def parse_completion_request(body: dict, limits: Limits, tokenizer: Any) -> GenRequest:
    f = Fields(body)
    model = check_model(f, limits)
    f.reject_if_set("suffix", "suffix / insertion", allowed=("",))
    flags = _stream_flags(f)
    stream = flags["stream"]
    echo = f.bool("echo", False)
    logprobs = f.int("logprobs", None, bound=SamplingParams.BOUNDS["logprobs"])
    sampling = _common_sampling(f, limits)
    sampling.update(openai_search(f, limits, n=sampling["n"], echo=echo, logprobs=logprobs, stream=stream))
    # scoring (echo + logprobs, prompt_logprobs): max_tokens 0 scores the prompt only
    scoring = "prompt_logprobs" in sampling
    max_tokens = f.int("max_tokens", None, lo=0) if scoring else \
        f.int("max_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"])
    prompt_ids, prompt_text = _completion_prompt(body, limits, tokenizer)
    sampling["max_tokens"] = 0 if max_tokens == 0 else resolve_max_tokens(
        max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids), limits, "max_tokens", "prompt")
    params = sampling_params({"beam_width": "best_of"}, logprobs=logprobs, **sampling)
    return GenRequest("completion", model, prompt_ids, prompt_text, params, **flags, echo=echo, top_logprobs=logprobs,
                      prompt_logprobs=f.get("prompt_logprobs") is not None, priority=f.int("priority", 0, bound=PRIORITY))


def _completion_prompt(body: dict, limits: Limits, tokenizer: Any) -> tuple[list[int], str]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "is required")
    if isinstance(p, list):
        if not p:
            raise bad("prompt", "must not be empty")
        if all(is_int(t) for t in p):
            ids = check_token_ids(p, "prompt", limits)
            return ids, decode_ids(tokenizer, ids, "prompt")
        if len(p) != 1:
            raise bad("prompt", "batched prompts are not supported; send one prompt per request",
                      code="unsupported")
        p = p[0]
        if isinstance(p, list):
            if not p:
                raise bad("prompt", "must not be empty")
            ids = check_token_ids(p, "prompt", limits)
            return ids, decode_ids(tokenizer, ids, "prompt")
    if not isinstance(p, str):
        raise bad("prompt", f"must be a string, an array of one string, or an array of token ids, "
                  f"got {type_name(p)}")
    if not p:
        raise bad("prompt", "must not be empty")
    return encode_text(tokenizer, p, "prompt"), p


def parse_chat_request(body: dict, limits: Limits, tokenizer: Any) -> GenRequest:
    f = Fields(body)
    model = check_model(f, limits)
    for key, why in (("functions", "function calling (use tools)"),
                     ("function_call", "function calling (use tool_choice)"), ("audio", "audio output"),
                     ("prediction", "predicted outputs")):
        f.reject_if_set(key, why)
    tool_spec = T.parse_tools(body)
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise bad("modalities", "only [\"text\"] is supported", code="unsupported")
    f.reject_if_set("use_beam_search", "beam search on chat completions (use /v1/completions)")
    flags = _stream_flags(f)
    want = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, bound=SamplingParams.BOUNDS["logprobs"])
    if top is not None and top > 0 and not want:
        raise bad("top_logprobs", "requires logprobs to be true")
    sampling = _common_sampling(f, limits)
    max_tokens = f.int("max_completion_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"])
    max_param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_param = f.int("max_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"]), "max_tokens"
    messages = openai_messages(body.get("messages"))
    add_gen = f.bool("add_generation_prompt", True)
    template_kwargs = f.template_kwargs("chat_template_kwargs")
    reasoning = reasoning_parser(limits.reasoning_parser, template_kwargs)
    if not f.bool("include_reasoning", True) and reasoning is not None:
        reasoning = dataclasses.replace(reasoning, hidden=True)
        want = False   # as vLLM: no logprobs either, they would show the hidden reasoning's tokens
    tool_constraint(sampling, tool_spec, "response_format or guided decoding")
    ids = chat_prompt_ids(messages, tool_spec, tokenizer, add_gen, template_kwargs=template_kwargs)
    sampling["max_tokens"] = resolve_max_tokens(max_tokens, None, len(ids), limits, max_param, "messages")
    k = (top or 0) if want else None
    params = sampling_params({"max_tokens": max_param, "logprobs": "top_logprobs"}, logprobs=k, **sampling)
    return GenRequest("chat", model, ids, "", params, **flags,
                      top_logprobs=k, tools=tool_spec, reasoning=reasoning,
                      priority=f.int("priority", 0, bound=PRIORITY))


def tool_constraint(sampling: dict[str, Any], spec: T.ToolSpec | None, other: str) -> None:
    """A required or named tool choice constrains the output to one call (``sampling["guided"]``);
    ``other``: what else may have set a constraint, for the error."""
    if spec is not None and spec.constrained:
        if "guided" in sampling:
            raise bad("tool_choice", f"a required or named tool choice cannot be combined with {other}")
        sampling["guided"] = T.call_grammar(spec)


def openai_messages(msgs: Any) -> list[dict]:
    """Chat ``messages`` -> the chat template's ``{"role", "content"}`` messages (the
    Responses API's input items come here too, as chat messages)."""
    out = []
    for name, m in objects(msgs, "messages", MAX_MESSAGES, "a message object", required="message"):
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{name}.role", "is required and must be a string")
        if role not in CHAT_ROLES:
            raise bad(f"{name}.role", f"unknown role {short(role)}; expected one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise bad(f"{name}.content", "is required")
            content = ""
        elif isinstance(content, list):
            content = _content_parts(content, f"{name}.content")
        elif not isinstance(content, str):
            raise bad(f"{name}.content", f"must be a string or an array of text parts, got {type_name(content)}")
        if role == "assistant" and m.get("tool_calls"):
            calls = T.assistant_calls_text(m["tool_calls"], f"{name}.tool_calls")
            content = T.with_calls(content, calls)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content_parts(parts: list, name: str) -> str:
    texts = []
    for pname, part in objects(parts, name, MAX_PARTS, "a content part object"):
        if part.get("type") != "text":
            raise bad(f"{pname}.type", f"only 'text' content parts are supported, got {short(part.get('type'))}",
                      code="unsupported")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{pname}.text", "must be a string")
        texts.append(text)
    return "\n".join(texts)

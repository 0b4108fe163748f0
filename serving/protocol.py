"""Request parsing and response shaping for the OpenAI- and TGI-compatible routes.

Parsing turns an untrusted JSON body into a ``GenRequest``: prompt token ids plus a
validated ``SamplingParams``. Every rejection is a ``ProtocolError`` whose message starts
with the offending field's name (``max_tokens: must be ...``) and whose ``param`` names it,
so the client sees which field to fix. Nothing here touches the network or the engine
loop; the tokenizer is the only engine part used (encode / chat template / decode).

Shaping turns the engine's cumulative ``RequestOutput`` into OpenAI ``text_completion`` /
``chat.completion`` bodies, their streamed chunks, and TGI's ``generate`` bodies and
stream events. ``DeltaTracker`` cuts cumulative outputs into per-choice deltas.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from jaxinfer.config import CompletionOutput, Logprob, RequestOutput, SamplingParams

MAX_STOP = 16            # stop strings per request
MAX_STOP_LEN = 1024      # characters per stop string
MAX_STOP_TOKEN_IDS = 64
DEFAULT_COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
DEFAULT_TGI_MAX_NEW_TOKENS = 100      # TGI's default
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MIN_LOGPROB = -9999.0    # JSON has no -inf; vLLM clamps the same way


# ------------------------------------------------------------------ errors

class ProtocolError(Exception):
    """A client error to answer with ``status`` and an error body naming ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.err_type = err_type or _default_type(status)
        self.headers = headers or {}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def openai_error_body(message: str, err_type: str, param: str | None = None,
                      code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def tgi_error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def bad(param: str, msg: str, **kw: Any) -> ProtocolError:
    return ProtocolError(f"{param}: {msg}", param=param, **kw)


# ------------------------------------------------------------------ JSON

# Longer integer literals are refused while parsing: no field takes one (seeds stop at 20
# digits), and Python's own limit (4300 digits) would answer with an interpreter hint.
MAX_INT_DIGITS = 64


class _BadLiteral(ValueError):
    """A JSON literal we refuse; its message is written for the client."""


def _reject_constant(name: str) -> Any:
    raise _BadLiteral(f"{name} is not valid JSON")


def _parse_int(s: str) -> int:
    if len(s) > MAX_INT_DIGITS + 1:
        raise _BadLiteral(f"an integer literal has {len(s.lstrip('-'))} digits (at most "
                          f"{MAX_INT_DIGITS} are accepted)")
    return int(s)


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body into a JSON object, or raise a ProtocolError saying why not."""
    if not raw.strip():
        raise ProtocolError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:
        raise ProtocolError("request body is nested too deeply", code="invalid_json")
    except (json.JSONDecodeError, _BadLiteral) as e:   # their messages name only the input
        raise ProtocolError(f"request body is not valid JSON: {e}", code="invalid_json")
    except ValueError:   # anything else the decoder raises: its text may be about Python
        raise ProtocolError("request body is not valid JSON", code="invalid_json")
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}",
                            code="invalid_json")
    _check_strings(body)
    return body


def _check_strings(body: dict) -> None:
    """Reject lone surrogates (legal in JSON escapes, not in UTF-8): tokenizers choke on them."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                name = path or "body"
                raise bad(name, "contains an invalid Unicode escape (lone surrogate)")
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and _has_surrogate(k):
                    raise ProtocolError("request body has a key with an invalid Unicode escape")
                stack.append((f"{path}.{k}" if path else str(k), x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


# ------------------------------------------------------------------ field readers

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v: Any, limit: int = 80) -> str:
    """repr() for error messages, cut short: never reflect a megabyte back at the client."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


class Fields:
    """Typed reads from a JSON object; ``None`` (absent or null) means "use the default"."""

    def __init__(self, d: dict, prefix: str = "") -> None:
        self.d = d
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        return self.d.get(key)

    def int(self, key: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not _is_int(v):
            raise bad(self.name(key), f"must be an integer, got {_type_name(v)}")
        if lo is not None and v < lo:
            raise bad(self.name(key), f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise bad(self.name(key), f"must be <= {hi}, got {v}")
        return v

    def num(self, key: str, default: float | None = None) -> float | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not _is_num(v) or not math.isfinite(v):
            raise bad(self.name(key), f"must be a finite number, got {_type_name(v)}")
        return float(v)

    def bool(self, key: str, default: bool | None = False) -> bool | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(self.name(key), f"must be a boolean, got {_type_name(v)}")
        return v

    def str(self, key: str, default: str | None = None) -> str | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(self.name(key), f"must be a string, got {_type_name(v)}")
        return v

    def obj(self, key: str) -> dict | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise bad(self.name(key), f"must be an object, got {_type_name(v)}")
        return v

    def stop(self, key: str = "stop") -> tuple[str, ...]:
        v = self.d.get(key)
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            raise bad(self.name(key), f"must be a string or an array of strings, got {_type_name(v)}")
        if len(items) > MAX_STOP:
            raise bad(self.name(key), f"at most {MAX_STOP} stop strings, got {len(items)}")
        for s in items:
            if not isinstance(s, str):
                raise bad(self.name(key), f"must contain only strings, got {_type_name(s)}")
            if not s:
                raise bad(self.name(key), "stop strings must not be empty")
            if len(s) > MAX_STOP_LEN:
                raise bad(self.name(key), f"stop strings must be at most {MAX_STOP_LEN} characters")
        return tuple(items)

    def token_ids(self, key: str, limits: "Limits", max_len: int | None = None) -> tuple[int, ...]:
        v = self.d.get(key)
        if v is None:
            return ()
        if not isinstance(v, list):
            raise bad(self.name(key), f"must be an array of token ids, got {_type_name(v)}")
        if max_len is not None and len(v) > max_len:
            raise bad(self.name(key), f"at most {max_len} token ids")
        return tuple(check_token_ids(v, self.name(key), limits))

    def reject_if_set(self, key: str, why: str, allowed: Iterable[Any] = ()) -> None:
        v = self.d.get(key)
        if v is None or v in ([], {}, False) or v in list(allowed):
            return
        raise bad(self.name(key), f"is not supported by this server ({why})", code="unsupported")


def check_token_ids(ids: Sequence[Any], name: str, limits: "Limits") -> list[int]:
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise bad(name, f"token ids must be integers, got {_type_name(t)} at index {i}")
        if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size):
            hi = f" and < {limits.vocab_size}" if limits.vocab_size is not None else ""
            raise bad(name, f"token id {t} at index {i} is out of range (must be >= 0{hi})")
    return list(ids)


# ------------------------------------------------------------------ requests

@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts: served model names, context length, sample count, vocab."""

    model_names: tuple[str, ...]
    max_model_len: int
    max_n: int
    vocab_size: int | None = None


@dataclass(slots=True)
class GenRequest:
    """One validated generation request, ready for ``engine.generate``."""

    kind: str                      # "completion" | "chat" | "tgi"
    model: str
    prompt_ids: list[int]
    prompt_text: str               # for echo / return_full_text
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None   # None: no logprobs in the response; k: chosen + top k
    tgi_details: bool = False
    return_full_text: bool = False
    tools: Any = None              # serving.tools.ToolSpec: parse the reply for tool calls
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _check_model(f: Fields, limits: Limits) -> str:
    model = f.str("model")
    if model is None:
        return limits.model_names[0]
    if model not in limits.model_names:
        raise bad("model", f"model {_short(model)} is not served here; available: "
                  f"{', '.join(limits.model_names)}", code="model_not_found")
    return model


def _resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int,
                        limits: Limits, param: str, prompt_param: str) -> int:
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad(prompt_param, f"the prompt is {prompt_len} tokens, which leaves no room to generate "
                  f"within the context length of {limits.max_model_len} tokens",
                  code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad(param, f"{requested} is too large: prompt tokens ({prompt_len}) + {param} must be "
                  f"<= the context length {limits.max_model_len}, so at most {room} here",
                  code="context_length_exceeded")
    return requested


def _sampling_params(aliases: dict[str, str], **kw: Any) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        field_name, _, rest = msg.partition(": ")
        api = aliases.get(field_name, field_name)
        raise bad(api, rest or msg) from None


def _common_sampling(f: Fields, limits: Limits) -> dict[str, Any]:
    """The sampling fields shared by /v1/completions and /v1/chat/completions (incl. vLLM's)."""
    from serving.guided_protocol import openai_constraints

    n = f.int("n", 1, lo=1)
    if n > limits.max_n:
        raise bad("n", f"must be <= {limits.max_n} on this server, got {n}")
    f.reject_if_set("use_beam_search", "beam search")
    return dict(openai_constraints(f, limits),
        n=n,
        temperature=f.num("temperature", 1.0),
        top_p=f.num("top_p", 1.0),
        top_k=f.int("top_k", 0),
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


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.bool("stream", False)
    opts = f.obj("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        include_usage = Fields(opts, "stream_options.").bool("include_usage", False)
        Fields(opts, "stream_options.").bool("continuous_usage_stats", False)
    return stream, include_usage


def parse_completion_request(body: dict, limits: Limits, tokenizer: Any) -> GenRequest:
    f = Fields(body)
    model = _check_model(f, limits)
    f.reject_if_set("suffix", "suffix / insertion", allowed=("",))
    best_of = f.int("best_of", None, lo=1)
    stream, include_usage = _stream_flags(f)
    echo = f.bool("echo", False)
    logprobs = f.int("logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise bad("echo", "echo together with logprobs is not supported (prompt logprobs are not computed)",
                  code="unsupported")
    sampling = _common_sampling(f, limits)
    if best_of is not None and best_of != sampling["n"]:
        raise bad("best_of", "best_of other than n is not supported", code="unsupported")
    max_tokens = f.int("max_tokens", None, lo=1)
    prompt_ids, prompt_text = _completion_prompt(body, limits, tokenizer)
    sampling["max_tokens"] = _resolve_max_tokens(max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                                                 len(prompt_ids), limits, "max_tokens", "prompt")
    params = _sampling_params({}, logprobs=logprobs, **sampling)
    return GenRequest("completion", model, prompt_ids, prompt_text, params, stream=stream,
                      include_usage=include_usage, echo=echo, top_logprobs=logprobs)


def _completion_prompt(body: dict, limits: Limits, tokenizer: Any) -> tuple[list[int], str]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "is required")
    if isinstance(p, list):
        if not p:
            raise bad("prompt", "must not be empty")
        if all(_is_int(t) for t in p):
            ids = check_token_ids(p, "prompt", limits)
            return ids, _decode(tokenizer, ids, "prompt")
        if len(p) != 1:
            raise bad("prompt", "batched prompts are not supported; send one prompt per request",
                      code="unsupported")
        p = p[0]
        if isinstance(p, list):
            if not p:
                raise bad("prompt", "must not be empty")
            ids = check_token_ids(p, "prompt", limits)
            return ids, _decode(tokenizer, ids, "prompt")
    if not isinstance(p, str):
        raise bad("prompt", f"must be a string, an array of one string, or an array of token ids, "
                  f"got {_type_name(p)}")
    if not p:
        raise bad("prompt", "must not be empty")
    try:
        ids = list(tokenizer.encode(p, add_special_tokens=True))
    except Exception as e:       # tokenizers reject odd input in their own ways
        raise bad("prompt", f"could not be tokenized: {e}") from None
    if not ids:
        raise bad("prompt", "tokenizes to no tokens")
    return ids, p


def _decode(tokenizer: Any, ids: list[int], param: str) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except Exception as e:
        raise bad(param, f"could not be decoded: {e}") from None


def parse_chat_request(body: dict, limits: Limits, tokenizer: Any) -> GenRequest:
    f = Fields(body)
    model = _check_model(f, limits)
    from serving import tools as T

    for key, why in (("functions", "function calling (use tools)"),
                     ("function_call", "function calling (use tool_choice)"), ("audio", "audio output"),
                     ("prediction", "predicted outputs")):
        f.reject_if_set(key, why)
    tool_spec = T.parse_tools(body)
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise bad("modalities", "only [\"text\"] is supported", code="unsupported")
    stream, include_usage = _stream_flags(f)
    want = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if top is not None and top > 0 and not want:
        raise bad("top_logprobs", "requires logprobs to be true")
    sampling = _common_sampling(f, limits)
    max_tokens = f.int("max_completion_tokens", None, lo=1)
    max_param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_param = f.int("max_tokens", None, lo=1), "max_tokens"
    messages = _chat_messages(body.get("messages"))
    add_gen = f.bool("add_generation_prompt", True)
    f.obj("chat_template_kwargs")
    if tool_spec is not None and tool_spec.constrained:
        if "guided" in sampling:
            raise bad("tool_choice", "a required or named tool choice cannot be combined with "
                      "response_format or guided decoding")
        sampling["guided"] = T.call_grammar(tool_spec)
    try:
        if tool_spec is not None:
            ids = list(T.render_messages(messages, tool_spec, tokenizer))
        else:
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen))
    except Exception as e:
        raise bad("messages", f"could not apply the chat template: {e}") from None
    if not ids:
        raise bad("messages", "the chat template produced no tokens")
    sampling["max_tokens"] = _resolve_max_tokens(max_tokens, None, len(ids), limits, max_param, "messages")
    k = (top or 0) if want else None
    params = _sampling_params({"max_tokens": max_param, "logprobs": "top_logprobs"}, logprobs=k, **sampling)
    return GenRequest("chat", model, ids, "", params, stream=stream, include_usage=include_usage,
                      top_logprobs=k, tools=tool_spec)


def _chat_messages(msgs: Any) -> list[dict]:
    if msgs is None:
        raise bad("messages", "is required")
    if not isinstance(msgs, list):
        raise bad("messages", f"must be an array of message objects, got {_type_name(msgs)}")
    if not msgs:
        raise bad("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(msgs):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(name, f"must be an object, got {_type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{name}.role", "is required and must be a string")
        if role not in CHAT_ROLES:
            raise bad(f"{name}.role", f"unknown role {_short(role)}; expected one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise bad(f"{name}.content", "is required")
            content = ""
        elif isinstance(content, list):
            content = _content_parts(content, f"{name}.content")
        elif not isinstance(content, str):
            raise bad(f"{name}.content", f"must be a string or an array of text parts, got {_type_name(content)}")
        if role == "assistant" and m.get("tool_calls"):
            from serving.tools import assistant_calls_text

            calls = assistant_calls_text(m["tool_calls"], f"{name}.tool_calls")
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content_parts(parts: list, name: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        pname = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise bad(pname, f"must be an object, got {_type_name(part)}")
        if part.get("type") != "text":
            raise bad(f"{pname}.type", f"only 'text' content parts are supported, got {_short(part.get('type'))}",
                      code="unsupported")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{pname}.text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def parse_tgi_request(body: dict, limits: Limits, tokenizer: Any, *, stream: bool) -> GenRequest:
    """TGI's ``{"inputs": ..., "parameters": {...}}``; TGI answers validation errors with 422."""
    try:
        return _parse_tgi(body, limits, tokenizer, stream)
    except ProtocolError as e:
        if e.status == 400:
            e.status = 422
        raise


def _parse_tgi(body: dict, limits: Limits, tokenizer: Any, stream: bool) -> GenRequest:
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise bad("inputs", "is required and must be a string" if inputs is None
                  else f"must be a string, got {_type_name(inputs)}")
    if not inputs:
        raise bad("inputs", "must not be empty")
    raw = body.get("parameters")
    if raw is not None and not isinstance(raw, dict):
        raise bad("parameters", f"must be an object, got {_type_name(raw)}")
    f = Fields(raw or {}, "parameters.")
    for key, why in (("decoder_input_details", "prompt logprobs are not computed"),
                     ("watermark", "watermarking"),
                     ("truncate", "input truncation"),
                     ("typical_p", "typical sampling")):
        f.reject_if_set(key, why)
    f.int("best_of", None, lo=1, hi=1)
    adapter = f.str("adapter_id")       # a LoRA adapter's name (serving/lora_routes.py)
    if adapter is not None and adapter not in limits.model_names:
        raise bad("parameters.adapter_id", f"no adapter {_short(adapter)} is loaded; available: "
                  f"{', '.join(limits.model_names[1:]) or 'none'}", code="model_not_found")
    temperature = f.num("temperature", None)
    if temperature is not None and temperature <= 0:
        raise bad("parameters.temperature", f"must be strictly positive, got {temperature}")
    top_p = f.num("top_p", None)
    top_k = f.int("top_k", None, lo=1)
    do_sample = f.bool("do_sample", False)
    sample = do_sample or temperature is not None or top_p is not None or top_k is not None
    seed = f.int("seed", None, lo=0, hi=SEED_MAX)
    if sample and seed is None:
        seed = uuid.uuid4().int & SEED_MAX          # TGI reports the seed it drew
    top_n = f.int("top_n_tokens", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    details = f.bool("details", False)
    try:
        ids = list(tokenizer.encode(inputs, add_special_tokens=True))
    except Exception as e:
        raise bad("inputs", f"could not be tokenized: {e}") from None
    if not ids:
        raise bad("inputs", "tokenizes to no tokens")
    max_new = _resolve_max_tokens(f.int("max_new_tokens", None, lo=1), DEFAULT_TGI_MAX_NEW_TOKENS,
                                  len(ids), limits, "parameters.max_new_tokens", "inputs")
    want_logprobs = stream or details
    aliases = {k: f"parameters.{k}" for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                               "frequency_penalty", "seed", "stop")}
    aliases["max_tokens"] = "parameters.max_new_tokens"
    aliases["logprobs"] = "parameters.top_n_tokens"
    from serving.guided_protocol import tgi_grammar

    params = _sampling_params(
        aliases,
        **tgi_grammar(f),
        max_tokens=max_new,
        temperature=(temperature if temperature is not None else 1.0) if sample else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        repetition_penalty=f.num("repetition_penalty", 1.0),
        frequency_penalty=f.num("frequency_penalty", 0.0),
        seed=seed,
        stop=f.stop("stop"),
        logprobs=(top_n or 0) if want_logprobs else None,
    )
    return GenRequest("tgi", adapter or limits.model_names[0], ids, inputs, params, stream=stream,
                      top_logprobs=top_n, tgi_details=details,
                      return_full_text=f.bool("return_full_text", False))


# ------------------------------------------------------------------ deltas

@dataclass(slots=True)
class Delta:
    """New text / tokens of one choice since the last delta that was emitted for it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    first: bool                   # the first delta of this choice


class DeltaTracker:
    """Cuts the engine's cumulative outputs into deltas per choice.

    A choice is emitted when it has new text or has just finished; tokens whose text is
    still held back (a possible stop string, an incomplete character) ride along with the
    next emitted delta, so text and logprobs stay aligned.
    """

    def __init__(self, n: int) -> None:
        self.text_len = [0] * n
        self.ntok = [0] * n
        self.done = [False] * n
        self.started = [False] * n

    def deltas(self, out: RequestOutput) -> list[Delta]:
        res = []
        for o in out.outputs:
            i = o.index
            if self.done[i]:
                continue
            # Cumulative text only grows (the engine holds back what it may retract); a
            # shorter snapshot would be an engine bug, and what was sent cannot be unsent.
            text = o.text[self.text_len[i]:]
            if not text and o.finish_reason is None:
                continue
            new = o.token_ids[self.ntok[i]:]
            lps = o.logprobs[self.ntok[i]:] if o.logprobs is not None else None
            res.append(Delta(i, text, list(new), lps, o.finish_reason, o.stop_reason, not self.started[i]))
            self.text_len[i] = max(self.text_len[i], len(o.text))
            self.ntok[i] = len(o.token_ids)
            self.started[i] = True
            self.done[i] = o.finish_reason is not None
        return res


# ------------------------------------------------------------------ OpenAI shapes

def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE (GPT-2 style) spells each byte as one printable character: printable
    Latin-1 bytes as themselves, the other bytes as U+0100 onwards, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    rest = [b for b in range(256) if b not in keep]
    table.update({chr(0x100 + i): b for i, b in enumerate(rest)})
    return table


_BYTE_LEVEL = _byte_level_table()


class TokenTexts:
    """Token id -> its text and its exact bytes (as shown in logprobs), cached per id.

    The text is ``decode([id])``. The bytes come from the vocabulary piece when the
    tokenizer exposes ``convert_ids_to_tokens`` (byte-level BPE or SentencePiece ``<0xNN>``
    pieces), so a token holding part of a multi-byte character reports its real bytes.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: dict[int, str] = {}
        self.byte_cache: dict[int, bytes] = {}
        self._byte_level: bool | None = None

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tok.decode([tid], skip_special_tokens=False)
            except Exception:
                s = f"<{tid}>"
            if len(self.cache) < 1_000_000:
                self.cache[tid] = s
        return s

    def bytes(self, tid: int) -> bytes:
        b = self.byte_cache.get(tid)
        if b is None:
            b = self._piece_bytes(tid)
            if b is None:
                b = self(tid).encode("utf-8", "replace")
            if len(self.byte_cache) < 1_000_000:
                self.byte_cache[tid] = b
        return b

    def _piece_bytes(self, tid: int) -> bytes | None:
        conv = getattr(self.tok, "convert_ids_to_tokens", None)
        if conv is None:
            return None
        try:
            piece = conv(tid)
            if self._byte_level is None:
                probe = "".join(conv(list(self.tok.encode(" é", add_special_tokens=False))))
                self._byte_level = (all(c in _BYTE_LEVEL for c in probe)
                                    and bytes(_BYTE_LEVEL[c] for c in probe) == " é".encode())
        except Exception:
            return None
        if not isinstance(piece, str) or not piece:
            return None
        if self._byte_level:
            if all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        return piece.replace("\u2581", " ").encode("utf-8")


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def output_usage(req: GenRequest, out: RequestOutput | None) -> dict:
    gen = sum(len(o.token_ids) for o in out.outputs) if out is not None else 0
    return usage(len(req.prompt_ids), gen)


def completion_logprobs(lps: Sequence[Logprob], k: int, texts: TokenTexts, offset: int) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` for these tokens; returns it and the next text offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = texts(lp.token_id)
        tokens.append(t)
        token_lps.append(_lp(lp.logprob))
        top = {texts(tid): _lp(v) for tid, v in lp.top[:k]}
        top.setdefault(t, _lp(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def _chat_lp_entry(texts: TokenTexts, tid: int, logprob: float) -> dict:
    return {"token": texts(tid), "logprob": _lp(logprob), "bytes": list(texts.bytes(tid))}


def chat_logprobs(lps: Sequence[Logprob], k: int, texts: TokenTexts) -> dict:
    content = []
    for lp in lps:
        e = _chat_lp_entry(texts, lp.token_id, lp.logprob)
        e["top_logprobs"] = [_chat_lp_entry(texts, tid, v) for tid, v in lp.top[:k]]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_id(req: GenRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.request_id


def completion_response(req: GenRequest, out: RequestOutput, texts: TokenTexts) -> dict:
    choices = []
    for o in out.outputs:
        prefix = req.prompt_text if req.echo else ""
        lp = None
        if req.top_logprobs is not None and o.logprobs is not None:
            lp, _ = completion_logprobs(o.logprobs, req.top_logprobs, texts, len(prefix))
        choices.append({"index": o.index, "text": prefix + o.text, "logprobs": lp,
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    return {"id": completion_id(req), "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": output_usage(req, out)}


def chat_response(req: GenRequest, out: RequestOutput, texts: TokenTexts) -> dict:
    choices = []
    for o in out.outputs:
        lp = None
        if req.top_logprobs is not None and o.logprobs is not None:
            lp = chat_logprobs(o.logprobs, req.top_logprobs, texts)
        message, finish = {"role": "assistant", "content": o.text, "tool_calls": []}, o.finish_reason
        if req.tools is not None:
            from serving.tools import parse_tool_calls

            content, calls = parse_tool_calls(o.text, req.tools)
            if calls:
                message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        choices.append({"index": o.index, "message": message,
                        "logprobs": lp, "finish_reason": finish, "stop_reason": o.stop_reason})
    return {"id": completion_id(req), "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": output_usage(req, out),
            "system_fingerprint": None}


class OpenAIStreamer:
    """Builds the SSE chunks of a streamed completion or chat completion."""

    def __init__(self, req: GenRequest, texts: TokenTexts) -> None:
        self.req = req
        self.texts = texts
        self.tracker = DeltaTracker(req.params.n)
        self.offsets = [len(req.prompt_text) if req.echo else 0] * req.params.n
        self.held: dict[int, str] = {}      # chat with tools: each choice's text until it ends

    def _chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        c = {"id": completion_id(self.req), "object": kind, "created": self.req.created,
             "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            c["usage"] = None
        return c

    def chunks(self, out: RequestOutput) -> list[dict]:
        res = []
        for d in self.tracker.deltas(out):
            if self.req.kind == "chat":
                res.extend(self._chat_chunks(d))
            else:
                res.append(self._completion_chunk(d))
        return res

    def _completion_chunk(self, d: Delta) -> dict:
        text = (self.req.prompt_text if self.req.echo and d.first else "") + d.text
        lp = None
        if self.req.top_logprobs is not None and d.logprobs is not None:
            if d.first and self.req.echo:
                self.offsets[d.index] = len(self.req.prompt_text)
            lp, self.offsets[d.index] = completion_logprobs(d.logprobs, self.req.top_logprobs,
                                                            self.texts, self.offsets[d.index])
        return self._chunk([{"index": d.index, "text": text, "logprobs": lp,
                             "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])

    def _chat_chunks(self, d: Delta) -> list[dict]:
        res = []
        if d.first:   # OpenAI opens each choice with the role
            res.append(self._chunk([{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        if self.req.tools is not None:
            # A reply may turn out to be tool calls: its text is held until it ends.
            from serving.tools import stream_tool_deltas

            return res + [self._chunk([c]) for c in stream_tool_deltas(self, d)]
        lp = None
        if self.req.top_logprobs is not None and d.logprobs is not None:
            lp = chat_logprobs(d.logprobs, self.req.top_logprobs, self.texts)
        delta = {"content": d.text} if d.text else {}
        res.append(self._chunk([{"index": d.index, "delta": delta, "logprobs": lp,
                                 "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]))
        return res

    def usage_chunk(self, out: RequestOutput | None) -> dict:
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": completion_id(self.req), "object": kind, "created": self.req.created,
                "model": self.req.model, "choices": [], "usage": output_usage(self.req, out)}


# ------------------------------------------------------------------ TGI shapes

def tgi_finish_reason(o: CompletionOutput) -> str:
    if o.finish_reason == "length":
        return "length"
    if o.finish_reason == "stop":
        return "stop_sequence" if isinstance(o.stop_reason, str) else "eos_token"
    return o.finish_reason or "length"


def _tgi_token(tid: int, text: str, lp: Logprob | None, special: set[int]) -> dict:
    return {"id": tid, "text": text, "logprob": _lp(lp.logprob) if lp is not None else None,
            "special": tid in special}


def _tgi_top(lp: Logprob | None, k: int | None, texts: TokenTexts, special: set[int]) -> list[dict]:
    if lp is None or not k:
        return []
    return [{"id": tid, "text": texts(tid), "logprob": _lp(v), "special": tid in special}
            for tid, v in lp.top[:k]]


def tgi_response(req: GenRequest, out: RequestOutput, texts: TokenTexts, special: set[int]) -> dict:
    o = out.outputs[0]
    body: dict[str, Any] = {"generated_text": (req.prompt_text if req.return_full_text else "") + o.text}
    if req.tgi_details:
        lps = o.logprobs or []
        tokens = [_tgi_token(t, texts(t), lps[j] if j < len(lps) else None, special)
                  for j, t in enumerate(o.token_ids)]
        details: dict[str, Any] = {"finish_reason": tgi_finish_reason(o), "generated_tokens": len(o.token_ids),
                                   "seed": req.params.seed, "prefill": [], "tokens": tokens}
        if req.top_logprobs:
            details["top_tokens"] = [_tgi_top(lps[j] if j < len(lps) else None, req.top_logprobs,
                                              texts, special) for j in range(len(o.token_ids))]
        body["details"] = details
    return body


class TGIStreamer:
    """TGI ``generate_stream`` events: one per token; the last carries generated_text and details.

    A token's ``text`` is the new text that arrived with it; when several tokens arrive
    together (or text was held back) the earlier ones carry "" and the last carries it all,
    so the concatenated token texts always equal ``generated_text``.
    """

    def __init__(self, req: GenRequest, texts: TokenTexts, special: set[int]) -> None:
        self.req = req
        self.texts = texts
        self.special = special
        self.tracker = DeltaTracker(1)
        self.count = 0

    def events(self, out: RequestOutput) -> list[dict]:
        res = []
        for d in self.tracker.deltas(out):
            lps = d.logprobs or []
            for j, tid in enumerate(d.token_ids):
                last = j == len(d.token_ids) - 1
                lp = lps[j] if j < len(lps) else None
                self.count += 1
                ev: dict[str, Any] = {"index": self.count,
                                      "token": _tgi_token(tid, d.text if last else "", lp, self.special),
                                      "generated_text": None, "details": None}
                if self.req.top_logprobs:
                    ev["top_tokens"] = _tgi_top(lp, self.req.top_logprobs, self.texts, self.special)
                if last and d.finish_reason is not None:
                    o = out.outputs[0]
                    ev["generated_text"] = (self.req.prompt_text if self.req.return_full_text else "") + o.text
                    ev["details"] = {"finish_reason": tgi_finish_reason(o),
                                     "generated_tokens": len(o.token_ids), "seed": self.req.params.seed}
                res.append(ev)
        return res


# ------------------------------------------------------------------ OpenAPI

_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": MAX_STOP}]}
_SAMPLING = dict(
    n={**_INT, "minimum": 1}, temperature={**_NUM, "minimum": 0}, top_p={**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    top_k={**_INT, "minimum": -1}, min_p={**_NUM, "minimum": 0, "maximum": 1},
    presence_penalty={**_NUM, "minimum": -2, "maximum": 2}, frequency_penalty={**_NUM, "minimum": -2, "maximum": 2},
    repetition_penalty={**_NUM, "exclusiveMinimum": 0}, seed={**_INT, "minimum": SEED_MIN, "maximum": SEED_MAX},
    stop=_STOP, stop_token_ids={"type": "array", "items": {**_INT, "minimum": 0}},
    ignore_eos=_BOOL, include_stop_str_in_output=_BOOL, skip_special_tokens=_BOOL,
    stream=_BOOL, stream_options={"type": "object", "properties": {"include_usage": _BOOL}},
    model=_STR, max_tokens={**_INT, "minimum": 1},
    cache_salt={**_STR, "minLength": 1, "maxLength": SamplingParams.MAX_CACHE_SALT_CHARS},
)


def openapi_schema() -> dict:
    """A hand-kept OpenAPI 3.1 description of the routes and their request bodies."""
    err = {"description": "error", "content": {"application/json": {"schema": {"type": "object"}}}}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    ok_sse = {"description": "OK (JSON, or server-sent events when stream is true)",
              "content": {"application/json": {}, "text/event-stream": {}}}

    def post(summary: str, schema: dict, stream: bool = True) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                         "responses": {"200": ok_sse if stream else ok_json, "400": err, "401": err,
                                       "413": err, "422": err, "503": err}}}

    completion = {"type": "object", "required": ["prompt"], "properties": {
        **_SAMPLING, "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 1},
                                          {"type": "array", "items": {**_INT, "minimum": 0}}]},
        "echo": _BOOL, "logprobs": {**_INT, "minimum": 0, "maximum": SamplingParams.MAX_LOGPROBS}}}
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STR}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"oneOf": [_STR, {"type": "array", "items": part}, {"type": "null"}]}}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        **_SAMPLING, "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": {**_INT, "minimum": 1}, "logprobs": _BOOL,
        "top_logprobs": {**_INT, "minimum": 0, "maximum": SamplingParams.MAX_LOGPROBS},
        "add_generation_prompt": _BOOL}}
    tgi = {"type": "object", "required": ["inputs"], "properties": {
        "inputs": {**_STR, "minLength": 1},
        "parameters": {"type": "object", "properties": dict(
            max_new_tokens={**_INT, "minimum": 1}, temperature={**_NUM, "exclusiveMinimum": 0},
            top_p={**_NUM, "exclusiveMinimum": 0, "maximum": 1}, top_k={**_INT, "minimum": 1},
            repetition_penalty={**_NUM, "exclusiveMinimum": 0}, frequency_penalty={**_NUM, "minimum": -2, "maximum": 2},
            seed={**_INT, "minimum": 0}, stop={"type": "array", "items": _STR}, do_sample=_BOOL, details=_BOOL,
            return_full_text=_BOOL, top_n_tokens={**_INT, "minimum": 0, "maximum": SamplingParams.MAX_LOGPROBS})}}}
    get = {"get": {"responses": {"200": ok_json}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxinfer", "version": "0.1.0",
                 "description": "OpenAI-compatible and TGI-compatible LLM serving on JAX"},
        "paths": {
            "/v1/completions": post("OpenAI text completion", completion),
            "/v1/chat/completions": post("OpenAI chat completion", chat),
            "/v1/models": get, "/v1/models/{model}": get,
            "/generate": post("TGI generate", tgi, stream=False),
            "/generate_stream": post("TGI generate, streamed", tgi),
            "/info": get, "/health": {"get": {"responses": {"200": ok_json, "503": err}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format"}}}},
        },
    }

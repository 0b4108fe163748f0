"""Request fields for constrained decoding: OpenAI ``response_format`` (and the Responses
API's ``text.format``) and ``logit_bias``,
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
``min_tokens`` and ``bad_words``, TGI's ``grammar``. Each becomes a ``SamplingParams``
keyword (the grammar itself is compiled and checked by the engine, whose error messages,
from llguidance, name what is wrong and come back as 400 / 422)."""

from __future__ import annotations

from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving.errors import bad
from serving.fields import Fields, Limits, is_num, type_name

GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def openai_constraints(f: Fields, limits: Limits) -> dict[str, Any]:
    """SamplingParams keywords from an OpenAI / vLLM body (only those that are set)."""
    f.reject_if_set("guided_whitespace_pattern", "a whitespace pattern for guided decoding")
    f.reject_if_set("guided_decoding_backend", "choosing the guided decoding backend (llguidance is used)")
    out: dict[str, Any] = {}
    guided = [(k, f.d[k]) for k in GUIDED_KEYS if f.d.get(k) is not None]
    fmt = _response_format(f)
    if fmt is not None:
        guided.append(("response_format", fmt))
    if len(guided) > 1:
        raise bad(guided[1][0], f"only one of {', '.join(GUIDED_KEYS)}, response_format may be set")
    if guided:
        key, value = guided[0]
        out["guided"] = value if key == "response_format" else _vllm_guided(f.name(key), key, value)
    bias = logit_bias(f, "logit_bias", limits)
    if bias:
        out["logit_bias"] = bias
    min_tokens = f.int("min_tokens", 0, bound=SamplingParams.BOUNDS["min_tokens"])
    if min_tokens:
        out["min_tokens"] = min_tokens
    words = f.d.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise bad(f.name("bad_words"), f"must be an array of strings, got {type_name(words)}")
        out["bad_words"] = tuple(words)
    return out


def _vllm_guided(name: str, key: str, value: Any) -> dict:
    kind = key.removeprefix("guided_")
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise bad(name, f"must be a JSON schema (an object or its text), got {type_name(value)}")
        return {"json": value}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad(name, "must be a non-empty array of strings")
        return {"choice": value}
    if not isinstance(value, str):
        raise bad(name, f"must be a string, got {type_name(value)}")
    return {kind: value}


def _response_format(f: Fields) -> dict | None:
    fmt = f.obj("response_format")
    return None if fmt is None else format_constraint(fmt, "response_format")


def format_constraint(fmt: dict, param: str, flat: bool = False) -> dict | None:
    """An output format -> ``SamplingParams.guided`` (None for plain text). Chat's
    ``response_format`` nests the schema under ``json_schema``; the Responses API's
    ``text.format`` (``flat``) holds ``name``, ``schema`` and ``strict`` itself."""
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js, where = (fmt, param) if flat else (fmt.get("json_schema"), f"{param}.json_schema")
        if not isinstance(js, dict):
            raise bad(where, f"must be an object, got {type_name(js)}")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad(f"{where}.schema", f"must be an object, got {type_name(schema)}")
        return {"json": schema or {"type": "object"}}
    raise bad(f"{param}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}")


def logit_bias(f: Fields, key: str, limits: Limits) -> dict[int, float]:
    v = f.d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f.name(key), f"must be an object mapping token ids to biases, got {type_name(v)}")
    out: dict[int, float] = {}
    for k, x in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad(f.name(key), f"keys must be token ids, got {k!r:.40}") from None
        if tid < 0 or (limits.vocab_size is not None and tid >= limits.vocab_size):
            raise bad(f.name(key), f"token id {tid} is out of range")
        if not is_num(x) or not -100 <= x <= 100:
            raise bad(f.name(key), f"biases must be numbers in [-100, 100], got {x!r:.40} for token {tid}")
        out[tid] = float(x)
    return out


def tgi_grammar(f: Fields) -> dict[str, Any]:
    """TGI's ``parameters.grammar``: ``{"type": "json" | "regex", "value": ...}``."""
    g = f.obj("grammar")
    if g is None:
        return {}
    name = f.name("grammar")
    kind, value = g.get("type"), g.get("value")
    if kind in ("json", "json_object", "json_schema"):
        if isinstance(value, dict) and kind == "json_schema" and isinstance(value.get("schema"), dict):
            value = value["schema"]
        if not isinstance(value, (dict, str)):
            raise bad(f"{name}.value", f"must be a JSON schema (an object or its text), got {type_name(value)}")
        return {"guided": {"json": value}}
    if kind == "regex":
        if not isinstance(value, str):
            raise bad(f"{name}.value", f"must be a string, got {type_name(value)}")
        return {"guided": {"regex": value}}
    raise bad(f"{name}.type", f"must be 'json' or 'regex', got {kind!r:.40}")

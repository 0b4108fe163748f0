"""Typed, bounded reads of request fields; every error names the field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from jaxinfer.sampling_params import SamplingParams
from serving.errors import bad


MAX_STOP = 16            # stop strings per request
MAX_STOP_LEN = 1024      # characters per stop string
MAX_STOP_TOKEN_IDS = 64
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
_TOP_K = SamplingParams.BOUNDS["top_k"]
MAX_TEMPLATE_KWARGS = 16          # chat_template_kwargs: entries per request
MAX_TEMPLATE_KWARG_CHARS = 1024   # ... characters per string value
_TEMPLATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")    # a Jinja variable's name


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts: served model names, context length, sample count, vocab."""

    model_names: tuple[str, ...]
    max_model_len: int
    max_n: int
    vocab_size: int | None = None
    reasoning_parser: str | None = None     # --reasoning-parser (serving/reasoning.py)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def short(v: Any, limit: int = 80) -> str:
    """repr() for error messages, cut short: never reflect a megabyte back at the client."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


MAX_TEXT_CHARS = 1 << 20      # one text block, part or string content of a chat-like route


def text(v: Any, name: str, limit: int = MAX_TEXT_CHARS) -> str:
    """A string field of at most ``limit`` characters; errors name the field."""
    if not isinstance(v, str):
        raise bad(name, f"must be a string, got {type_name(v)}")
    if len(v) > limit:
        raise bad(name, f"must be at most {limit} characters, got {len(v)}")
    return v


def objects(v: Any, name: str, limit: int, item: str = "an object", required: str | None = None
            ) -> list[tuple[str, dict]]:
    """A JSON array of at most ``limit`` objects -> (field name, object) of each ("messages[3]"),
    for the routes' messages, blocks and parts. ``required``: the array may not be absent or
    empty (the message says what it must contain); errors name the array or the item."""
    if v is None and required:
        raise bad(name, "is required")
    if not isinstance(v, list):
        raise bad(name, f"must be an array of {item.split(' ', 1)[-1]}s, got {type_name(v)}")
    if not v and required:
        raise bad(name, f"must contain at least one {required}")
    if len(v) > limit:
        raise bad(name, f"at most {limit} items, got {len(v)}")
    out = []
    for j, x in enumerate(v):
        if not isinstance(x, dict):
            raise bad(f"{name}[{j}]", f"must be {item}, got {type_name(x)}")
        out.append((f"{name}[{j}]", x))
    return out


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
            hi: int | None = None, bound: Any = None) -> int | None:
        """``bound``: a jaxinfer.bounds.Bound giving lo and hi (the field's one declared range)."""
        if bound is not None:
            lo, hi = bound.lo, bound.hi
        v = self.d.get(key)
        if v is None:
            return default
        if not is_int(v):
            raise bad(self.name(key), f"must be an integer, got {type_name(v)}")
        if lo is not None and v < lo:
            raise bad(self.name(key), f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise bad(self.name(key), f"must be <= {hi}, got {v}")
        return v

    def top_k(self, key: str, default: int | None, limits: "Limits", lo: int = -1) -> int | None:
        """top_k, at most the vocabulary (a larger k keeps every token: say so, not crash
        on an int32 array)."""
        v = self.int(key, default, lo=lo, hi=_TOP_K.hi)
        if v is not None and limits.vocab_size is not None and v > limits.vocab_size:
            raise bad(self.name(key), f"must be <= the vocabulary size {limits.vocab_size}, got {v}")
        return v

    def num(self, key: str, default: float | None = None) -> float | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not is_num(v) or not math.isfinite(v):
            raise bad(self.name(key), f"must be a finite number, got {type_name(v)}")
        return float(v)

    def bool(self, key: str, default: bool | None = False) -> bool | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(self.name(key), f"must be a boolean, got {type_name(v)}")
        return v

    def str(self, key: str, default: str | None = None) -> str | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(self.name(key), f"must be a string, got {type_name(v)}")
        return v

    def obj(self, key: str) -> dict | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise bad(self.name(key), f"must be an object, got {type_name(v)}")
        return v

    def template_kwargs(self, key: str) -> dict[str, Any]:
        """A chat template's extra variables (``{"enable_thinking": false}``): a small object of
        JSON scalars, each name a template variable's. A name the template call itself takes
        (``tokenize``, ``tools``) is refused by the tokenizer (jaxinfer/loading/tokenizer.py)."""
        d = self.obj(key)
        if d is None:
            return {}
        if len(d) > MAX_TEMPLATE_KWARGS:
            raise bad(self.name(key), f"at most {MAX_TEMPLATE_KWARGS} entries, got {len(d)}")
        for k, v in d.items():
            if not _TEMPLATE_NAME.match(k):
                raise bad(self.name(key), f"names must be 1-64 letters, digits or '_' (not starting "
                          f"with a digit), got {short(k)}")
            name = f"{self.name(key)}.{k}"
            if isinstance(v, (dict, list)):
                raise bad(name, f"must be a string, number, boolean or null, got {type_name(v)}")
            if isinstance(v, str) and len(v) > MAX_TEMPLATE_KWARG_CHARS:
                raise bad(name, f"at most {MAX_TEMPLATE_KWARG_CHARS} characters, got {len(v)}")
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(name, "must be finite")
        return dict(d)

    def stop(self, key: str = "stop") -> tuple[str, ...]:
        v = self.d.get(key)
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            raise bad(self.name(key), f"must be a string or an array of strings, got {type_name(v)}")
        if len(items) > MAX_STOP:
            raise bad(self.name(key), f"at most {MAX_STOP} stop strings, got {len(items)}")
        for s in items:
            if not isinstance(s, str):
                raise bad(self.name(key), f"must contain only strings, got {type_name(s)}")
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
            raise bad(self.name(key), f"must be an array of token ids, got {type_name(v)}")
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
        if not is_int(t):
            raise bad(name, f"token ids must be integers, got {type_name(t)} at index {i}")
        if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size):
            hi = f" and < {limits.vocab_size}" if limits.vocab_size is not None else ""
            raise bad(name, f"token id {t} at index {i} is out of range (must be >= 0{hi})")
    return list(ids)

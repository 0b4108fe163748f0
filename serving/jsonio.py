"""Untrusted request bodies -> JSON objects, and responses -> bytes."""

from __future__ import annotations

import json
from typing import Any

from serving.errors import ProtocolError, bad


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

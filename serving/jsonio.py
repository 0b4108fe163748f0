"""Untrusted request bodies -> JSON objects, and responses -> bytes."""

from __future__ import annotations

import json
from typing import Any

from jaxinfer import untrusted_json
from serving.errors import ProtocolError, bad


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body into a JSON object, or raise a ProtocolError saying why not."""
    if not raw.strip():
        raise ProtocolError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_json")
    try:
        body = untrusted_json.loads(text)
    except untrusted_json.UntrustedJSONError as e:   # its message names only the input
        raise ProtocolError(f"request body {e}", code="invalid_json") from None
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

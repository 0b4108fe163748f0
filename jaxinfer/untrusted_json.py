"""JSON text from a client (a request body, a schema sent as a string) -> Python values,
refusing what would crash or hang the parser or echo interpreter details: nesting past
Python's recursion limit, integer literals of thousands of digits (Python's own limit
answers with a hint about ``sys.set_int_max_str_digits``), NaN / Infinity, and nesting
deeper than a caller's bound. Errors are ``UntrustedJSONError`` (a ValueError) whose
message names only the input and reads after the input's name ("is not valid JSON: ...",
"is nested too deeply")."""

from __future__ import annotations

import json
import math
from typing import Any

# No field takes a longer integer (seeds stop at 20 digits); a schema's bounds neither.
MAX_INT_DIGITS = 64


class UntrustedJSONError(ValueError):
    """The text is refused; the message is written for the client."""


class _BadLiteral(ValueError):
    """A literal the parse hooks refuse."""


def _reject_constant(name: str) -> Any:
    raise _BadLiteral(f"{name} is not valid JSON")


def _parse_int(s: str) -> int:
    if len(s) > MAX_INT_DIGITS + 1:
        raise _BadLiteral(f"an integer literal has {len(s.lstrip('-'))} digits (at most "
                          f"{MAX_INT_DIGITS} are accepted)")
    return int(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _BadLiteral(f"the number {s[:40]} is out of range")
    return v


def loads(text: str, max_depth: int | None = None) -> Any:
    """Parse ``text``; ``max_depth``: the most arrays/objects nested in one another."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int,
                           parse_float=_parse_float)
    except RecursionError:
        raise UntrustedJSONError("is nested too deeply") from None
    except (json.JSONDecodeError, _BadLiteral) as e:     # their messages name only the input
        raise UntrustedJSONError(f"is not valid JSON: {e}") from None
    except ValueError:                     # anything else the decoder raises may be about Python
        raise UntrustedJSONError("is not valid JSON") from None
    if max_depth is not None:
        check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int) -> None:
    """Raise if arrays/objects nest deeper than ``max_depth`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > max_depth:
                raise UntrustedJSONError(f"is nested deeper than {max_depth} levels")
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))

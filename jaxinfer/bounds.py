"""Validation helpers of the configuration records: ``require`` (a ValueError that names the
field) and ``Bound`` (a numeric field's range, declared once)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1            # the device's token / count arrays are int32


def require(cond: bool, name: str, msg: str) -> None:
    """ValueError "name: msg" unless ``cond``."""
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True, slots=True)
class Bound:
    """A numeric request field's range, declared once: ``SamplingParams`` enforces it, the
    HTTP parsers read it, and the server's OpenAPI schema publishes it."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False            # lo itself excluded
    note: str = ""                   # what special values mean

    def ok(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(v):
            return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return lo_ok and (self.hi is None or v <= self.hi)

    def text(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo, hi = _num_text(self.lo), _num_text(self.hi)
        if self.lo is not None and self.hi is not None:
            rng = f" in {'(' if self.lo_open else '['}{lo}, {hi}]"
        elif self.lo is not None:
            rng = f" {'>' if self.lo_open else '>='} {lo}"
        else:
            rng = f" <= {hi}" if self.hi is not None else ""
        return kind + rng + (f" ({self.note})" if self.note else "")

    def schema(self) -> dict[str, Any]:
        """JSON-schema keywords for this range."""
        out: dict[str, Any] = {"type": "integer" if self.integer else "number"}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


def _num_text(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


# A request's scheduling priority (lower runs first): vLLM's int64 range.
PRIORITY = Bound(True, -(2**63), 2**63 - 1, note="lower runs first; non-zero only under the priority policy")

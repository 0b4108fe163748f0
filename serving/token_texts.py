"""How a token is shown in responses: its text, its exact bytes, a finite logprob."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any


MIN_LOGPROB = -9999.0    # JSON has no -inf; vLLM clamps the same way


@lru_cache(maxsize=1)
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it spells (the inverse of the
    tokenizer's GPT-2 byte alphabet)."""
    from jaxinfer.loading.tokenizer import byte_alphabet

    return {c: b for b, c in byte_alphabet().items()}


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
                table = _byte_level()
                self._byte_level = (all(c in table for c in probe)
                                    and bytes(table[c] for c in probe) == " é".encode())
        except Exception:
            return None
        if not isinstance(piece, str) or not piece:
            return None
        if self._byte_level:
            table = _byte_level()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        return piece.replace("\u2581", " ").encode("utf-8")




def finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB

"""Incremental detokenization with stop strings (host only, no jax).

Decoding each token alone breaks two things: multi-byte characters split across tokens
(an emoji's bytes come in several byte-level tokens; alone each decodes to U+FFFD), and
word-initial spaces that SentencePiece-style decoders strip from the first token of
whatever they decode. So, like vLLM's ``detokenize_incrementally``, we decode a short
window of ids twice: ``ids[prefix:read]`` (text already emitted) and ``ids[prefix:]``
(that plus the new tokens); the delta is the difference. Both decodes start at the same
token, so any stripping at the window's start cancels out, and a few prompt tokens seed
the window so the first output token keeps its leading space.

A decode ending in U+FFFD may be an incomplete character whose remaining bytes are still
to come: the trailing run of U+FFFD is held back (the text before it is emitted) and the
window is not advanced until the character completes. ``finish`` flushes whatever is
still held. A window that grows past ``_MAX_WINDOW`` tokens without completing (byte
soup from a broken model) is force-advanced, so decoding stays O(window) per token.

Stop strings: the emitted stream never contains text past a stop string. Text that
could still be the start of a stop string (the longest suffix that is a prefix of one,
at most ``max(len(stop)) - 1`` characters) is held back until it can't be. When a stop
string completes, the text is cut just before it (or just after it with
``include_stop_str_in_output``), ``stopped_by`` names it, and later tokens are ignored.
With several stop strings, the one that completes first in the text wins (ties: the
longer one, i.e. the earlier start).
"""

from __future__ import annotations

from typing import Any, Protocol

# Prompt tokens decoded as left context for the first output token (as vLLM does).
_PROMPT_CONTEXT = 5
# Beyond this many undecided tokens a trailing U+FFFD is taken as final.
_MAX_WINDOW = 32
_REPLACEMENT = "\ufffd"


class _Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Tokenizer | Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._num_context = len(self._ids)
        self._prefix = 0                  # window start (token index into _ids)
        self._read = len(self._ids)       # tokens before this are fully emitted into _buf
        self._win_chars = 0               # chars of the open window already put into _buf
        self._buf = ""                    # decoded output text (held-back parts included)
        self._emitted = 0                 # chars of _buf handed out as deltas
        self.stopped_by: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The text handed out so far (all deltas joined); the final text once finished."""
        return self._buf[:self._emitted]

    @property
    def text_len(self) -> int:
        return self._emitted

    def text_since(self, start: int) -> str:
        """``text[start:]`` without copying the text before ``start``."""
        return self._buf[start:self._emitted]

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def append(self, token_id: int) -> str:
        """Feed one sampled token; return the new text that is safe to show ("" if none).

        After a stop string has been found (``stopped_by`` set) or ``finish``, tokens
        are ignored and "" is returned.
        """
        if self.finished:
            return ""
        self._ids.append(token_id)
        return self._on_text(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """The sequence ended (EOS, length, abort): flush and return everything held back."""
        if self.finished:
            return ""
        return self._on_text(self._decode_new(final=True), final=True)

    # ---- internals ----------------------------------------------------------------
    def _decode_new(self, final: bool) -> str:
        """New decoded characters of the window, holding back an incomplete character."""
        if self._read == len(self._ids):
            return ""
        ids = self._ids
        prefix_text = self._tok.decode(ids[self._prefix:self._read], skip_special_tokens=self._skip)
        new_text = self._tok.decode(ids[self._prefix:], skip_special_tokens=self._skip)
        done = len(ids) - self._prefix > _MAX_WINDOW or final
        if not done and new_text.endswith(_REPLACEMENT):
            stable = new_text.rstrip(_REPLACEMENT)
        else:
            stable = new_text
        start = len(prefix_text) + self._win_chars
        delta = stable[start:]
        # Close the window only once it decodes to something complete: a window that
        # produced nothing (e.g. a skipped special token) would lose the left context.
        if len(stable) == len(new_text) and (len(new_text) > len(prefix_text) or done):
            self._prefix, self._read, self._win_chars = self._read, len(ids), 0
        else:
            self._win_chars += len(delta)
        return delta

    def _on_text(self, delta: str, final: bool) -> str:
        old_len = len(self._buf)
        self._buf += delta
        if self._stops:
            cut = self._find_stop(old_len)
            if cut is not None:
                self._buf = self._buf[:cut]
                final = True
        if final:
            self.finished = True
            safe = len(self._buf)
        else:
            safe = max(len(self._buf) - self._stop_prefix_len(), self._emitted)
        out = self._buf[self._emitted:safe]
        self._emitted = safe
        return out

    def _find_stop(self, old_len: int) -> int | None:
        """Search text new since ``old_len``; set ``stopped_by``, return where to cut."""
        best: tuple[int, int, str] | None = None     # (end, -len, stop)
        for s in self._stops:
            i = self._buf.find(s, max(0, old_len - len(s) + 1))
            if i >= 0:
                cand = (i + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        end, neg_len, s = best
        self.stopped_by = s
        return end if self._include_stop else end + neg_len

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that some stop string starts with."""
        buf = self._buf
        for k in range(min(self._max_stop - 1, len(buf) - self._emitted), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

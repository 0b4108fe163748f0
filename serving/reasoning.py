"""Reasoning output: a thinking model's ``<think>...</think>`` text apart from its answer
(vLLM's ``--reasoning-parser``).

A parser is a small state machine over the text: each state writes to one channel
(reasoning or content) and knows the tags that move it to another state. The same
machine splits a whole reply (``ReasoningParser.split``) and a streamed one
(``ReasoningParser.stream``: text deltas in, (reasoning, content) deltas out); a tail that
may still grow into a tag (``...</thi``) is held back until it is decided, so the streamed
deltas joined are exactly the whole reply's split, however the text is cut.

The parsers, by vLLM's names (its 0.32 behaviour, where that can be streamed):

- ``deepseek_r1``: everything up to the first ``</think>`` is reasoning (the chat template
  may have written the opening ``<think>`` into the prompt); one ``<think>`` before it is
  dropped; no ``</think>`` at all: all of it is reasoning. After it, content, verbatim.
  (vLLM's whole-text split also drops any text before that ``<think>``; its streaming
  keeps it as reasoning, as here.)
- ``qwen3``: the same, except that every ``<think>`` while reasoning and every further
  ``</think>`` are dropped, and a ``<tool_call>`` ends the reasoning (the tag stays in the
  content, for the tool-call parser). With ``chat_template_kwargs.enable_thinking: false``
  it is all content.
- ``deepseek_v3``: ``deepseek_r1`` when ``chat_template_kwargs`` sets ``thinking`` or
  ``enable_thinking``; all content otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

THINK_START, THINK_END, TOOL_START = "<think>", "</think>", "<tool_call>"
REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True, slots=True)
class Move:
    """On ``tag`` in this state: go to ``to``; ``keep``: the tag itself goes on into the
    new state's channel (else it is dropped)."""

    tag: str
    to: str
    keep: bool = False


@dataclass(frozen=True, slots=True)
class Machine:
    """``states``: name -> (channel, moves); ``start``: the first state."""

    start: str
    states: Mapping[str, tuple[str, tuple[Move, ...]]]


_R1 = Machine("open", {
    "open": (REASONING, (Move(THINK_START, "thinking"), Move(THINK_END, "answer"))),
    "thinking": (REASONING, (Move(THINK_END, "answer"),)),
    "answer": (CONTENT, ()),
})
_QWEN3 = Machine("thinking", {
    "thinking": (REASONING, (Move(THINK_START, "thinking"), Move(THINK_END, "answer"),
                             Move(TOOL_START, "answer", keep=True))),
    "answer": (CONTENT, (Move(THINK_END, "answer"),)),
})
_CONTENT_ONLY = Machine("answer", {"answer": (CONTENT, ())})


class ReasoningStream:
    """One reply's split as it streams: ``feed`` each text delta, then ``finish``; each
    returns the (reasoning, content) text that is decided by then."""

    def __init__(self, machine: Machine) -> None:
        self.m = machine
        self.state = machine.start
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        out = {REASONING: [], CONTENT: []}
        while True:
            channel, moves = self.m.states[self.state]
            at, move = _first_tag(self.buf, moves)
            if move is None:
                break
            out[channel].append(self.buf[:at])
            self.state = move.to
            if move.keep:
                out[self.m.states[move.to][0]].append(move.tag)
            self.buf = self.buf[at + len(move.tag):]
        # A tag may still be forming at the end: hold that tail until the next delta says.
        cut = len(self.buf) - _partial_tag_len(self.buf, moves)
        out[channel].append(self.buf[:cut])
        self.buf = self.buf[cut:]
        return "".join(out[REASONING]), "".join(out[CONTENT])

    def finish(self) -> tuple[str, str]:
        """The held tail, now that no more text comes: it was no tag after all."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.m.states[self.state][0] == REASONING else ("", rest)


def _first_tag(text: str, moves: tuple[Move, ...]) -> tuple[int, Move | None]:
    best, found = -1, None
    for mv in moves:
        i = text.find(mv.tag)
        if i >= 0 and (found is None or i < best):
            best, found = i, mv
    return best, found


def _partial_tag_len(text: str, moves: tuple[Move, ...]) -> int:
    """The longest end of ``text`` that is a proper prefix of one of the tags."""
    longest = 0
    for mv in moves:
        for k in range(min(len(mv.tag) - 1, len(text)), longest, -1):
            if mv.tag.startswith(text[-k:]):
                longest = k
                break
    return longest


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A parser as one request uses it (its chat template kwargs already applied).
    ``hidden``: the request asked for no reasoning in its answer (vLLM's
    ``include_reasoning: false``): it is still split off, then dropped."""

    name: str
    machine: Machine
    hidden: bool = False

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.machine)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole reply -> (reasoning, or None when there is none; content)."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, c1 + c2


def _thinking_on(kwargs: Mapping[str, Any], default: bool) -> bool:
    v = kwargs.get("enable_thinking")
    return default if v is None else bool(v)


_MACHINES: dict[str, Callable[[Mapping[str, Any]], Machine]] = {
    "deepseek_r1": lambda kw: _R1,
    "qwen3": lambda kw: _QWEN3 if _thinking_on(kw, True) else _CONTENT_ONLY,
    "deepseek_v3": lambda kw: _R1 if (bool(kw.get("thinking")) or _thinking_on(kw, False)) else _CONTENT_ONLY,
}
PARSER_NAMES: tuple[str, ...] = tuple(_MACHINES)


def reasoning_parser(name: str | None, template_kwargs: Mapping[str, Any] | None = None
                     ) -> ReasoningParser | None:
    """The server's ``--reasoning-parser`` for one request (None: no parser)."""
    if name is None:
        return None
    if name not in _MACHINES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")
    return ReasoningParser(name, _MACHINES[name](template_kwargs or {}))

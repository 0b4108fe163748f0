"""Anthropic Messages API answers: the ``message`` body, its stream of events and errors,
as the ``ANTHROPIC`` Dialect (serving/dialect.py).

The reply's text goes through one place on its way into content blocks: ``reply_blocks``
for a whole reply, ``AnthropicStream._text_of`` for a streamed one. A reply with
``<tool_call>`` blocks (serving/tools.py) becomes ``tool_use`` blocks. With
``--reasoning-parser`` (serving/reasoning.py) the thinking is split off first, into a
``thinking`` block (streamed as ``thinking_delta`` events, closed by a ``signature_delta``)
before them.

The stream follows Anthropic's documented order: ``message_start``, ``ping``, then per
content block ``content_block_start``, its ``content_block_delta`` events (``text_delta``
or ``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop_reason,
usage) and ``message_stop``; a failure after the headers went out is an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from jaxinfer.outputs import CompletionOutput, RequestOutput
from serving import tools as T
from serving.dialect import Answering, Dialect, sse
from serving.errors import ProtocolError, anthropic_error_body
from serving.request import GenRequest
from serving.stream import DeltaTracker

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: ProtocolError) -> tuple[dict, int]:
    # Anthropic answers an unknown model with 404 not_found_error.
    status = 404 if e.code == "model_not_found" else e.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return anthropic_error_body(e.message, kind), status


def message_id(req: GenRequest) -> str:
    return "msg_" + req.request_id


def stop_reason(o: CompletionOutput, tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if tool_use:
        return "tool_use", None
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):          # one of stop_sequences
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _tool_use(call: dict) -> dict:
    """serving/tools.py's OpenAI-shaped call -> a ``tool_use`` block."""
    fn = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
            "input": json.loads(fn["arguments"])}


def reply_blocks(req: GenRequest, text: str) -> list[dict]:
    """A whole reply's text -> its content blocks (thinking, text, then any tool_use)."""
    thinking: list[dict] = []
    if req.reasoning is not None:
        thought, text = req.reasoning.split(text)
        if thought is not None:
            thinking = [{"type": "thinking", "thinking": thought, "signature": _signature(req)}]
    if req.tools is not None:
        content, calls = T.parse_tool_calls(text, req.tools)
        if calls:
            return thinking + ([{"type": "text", "text": content}] if content else []) + [_tool_use(c) for c in calls]
    return thinking + ([{"type": "text", "text": text}] if text or not thinking else [])


def _signature(req: GenRequest) -> str:
    """A thinking block's ``signature``: Anthropic's proves the block came from its API; ours
    is only a stable id (as vLLM sends one), checked by nobody."""
    return "sig_" + req.request_id


def _usage(req: GenRequest, output_tokens: int) -> dict:
    return {"input_tokens": len(req.prompt_ids), "output_tokens": output_tokens}


def message_response(req: GenRequest, out: RequestOutput, a: Answering) -> dict:
    o = out.outputs[0]
    blocks = reply_blocks(req, o.text)
    reason, seq = stop_reason(o, any(b["type"] == "tool_use" for b in blocks))
    return {"id": message_id(req), "type": "message", "role": "assistant", "model": req.model,
            "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(req, len(o.token_ids))}


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)


class AnthropicStream:
    """One streamed message. Text streams as a text block as it comes; with tools, text
    from a ``<tool_call>`` tag on is held (serving/tools.py:hold_tool_text) until the
    reply ends, then goes out as tool_use blocks (or as text if it parses as no call)."""

    def __init__(self, req: GenRequest, a: Answering) -> None:
        self.req = req
        self.tracker = DeltaTracker(1)
        self.held = ""               # text held back while it may be a tool call
        self.index = 0               # the next content block's index
        self.open = False            # a text block is open
        self.thinking = req.reasoning.stream() if req.reasoning is not None else None
        self.thinking_open = False   # a thinking block is open
        self.started = self.finished = self.tool_use = False

    def events(self, out: RequestOutput) -> Iterable[bytes]:
        ev = self._begin()
        for d in self.tracker.deltas(out):
            ev += self._delta(d.text, d.finish_reason is not None)
            if d.finish_reason is not None:
                ev += self._finish()
        return ev

    def _delta(self, text: str, last: bool) -> list[bytes]:
        """New reply text -> its events: thinking first (the parser's split), then text."""
        ev = []
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
            if last:
                more_thought, more = self.thinking.finish()
                thought, text = thought + more_thought, text + more
            ev += self._thought(thought)
            if text or last:     # the thinking is over
                ev += self._close_thinking()
        return ev + self._text(self._text_of(text))

    def _thought(self, thought: str) -> list[bytes]:
        if not thought:
            return []
        ev = [] if self.thinking_open else [self._start({"type": "thinking", "thinking": ""})]
        self.thinking_open = True
        return ev + [_event("content_block_delta", index=self.index,
                            delta={"type": "thinking_delta", "thinking": thought})]

    def _close_thinking(self) -> list[bytes]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [_event("content_block_delta", index=self.index,
                       delta={"type": "signature_delta", "signature": _signature(self.req)}), self._stop()]

    def end(self, last: RequestOutput) -> Iterable[bytes]:
        o = last.outputs[0]
        ev = self._begin() + ([] if self.finished else self._delta("", True) + self._finish())
        reason, seq = stop_reason(o, self.tool_use)
        return ev + [_event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                            usage={"output_tokens": len(o.token_ids)}),
                     _event("message_stop")]

    def failure(self, message: str, code: str) -> Iterable[bytes]:
        kind = "overloaded_error" if code == "engine_dead" else "api_error"
        return [sse(anthropic_error_body(message, kind), event="error")]

    def _begin(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        msg = {"id": message_id(self.req), "type": "message", "role": "assistant", "model": self.req.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(self.req, 0)}
        return [_event("message_start", message=msg), _event("ping")]

    def _text_of(self, new: str) -> str:
        """The part of the new text that can stream now (the rest is held)."""
        if self.req.tools is None:
            return new
        now, self.held = T.hold_tool_text(self.held, new, self.req.tools)
        return now

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        ev = [] if self.open else [self._start({"type": "text", "text": ""})]
        self.open = True
        return ev + [_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})]

    def _start(self, block: dict) -> bytes:
        return _event("content_block_start", index=self.index, content_block=block)

    def _stop(self) -> bytes:
        self.index += 1
        return _event("content_block_stop", index=self.index - 1)

    def _finish(self) -> list[bytes]:
        """The reply ended: what was held goes out, as tool_use blocks or text; blocks close."""
        self.finished = True
        content, calls = T.parse_tool_calls(self.held, self.req.tools) if self.held else (None, [])
        self.held = ""
        ev = self._text(content or "")
        if not self.open and not calls and self.index == 0:     # an empty reply: one empty text block
            ev.append(self._start({"type": "text", "text": ""}))
            self.open = True
        if self.open:
            ev.append(self._stop())
            self.open = False
        for c in map(_tool_use, calls):
            self.tool_use = True
            ev.append(self._start({**c, "input": {}}))
            ev.append(_event("content_block_delta", index=self.index,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(c["input"])}))
            ev.append(self._stop())
        return ev


ANTHROPIC = Dialect("anthropic", anthropic_error, message_response, AnthropicStream)

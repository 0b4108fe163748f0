"""How each API answers a generation: its error body, its final response and its stream.

Every generation route runs the same path (serving/app.py ``run_generation``); what differs
between OpenAI's, TGI's and any other API's answer lives in a ``Dialect``: the route picks
one, and a new API is a new ``Dialect`` (its own request parser and response module), not
a second path through the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from jaxinfer.outputs import RequestOutput
from serving.errors import ProtocolError, openai_error_body, tgi_error_body
from serving.jsonio import dumps
from serving.openai_response import OpenAIStreamer, chat_response, completion_response
from serving.request import GenRequest
from serving.tgi_response import TGIStreamer, tgi_response
from serving.token_texts import TokenTexts


@dataclass(frozen=True, slots=True)
class Answering:
    """What a response builder needs besides the request and the output."""

    texts: TokenTexts
    eos_token_ids: frozenset[int]


class Stream(Protocol):
    """One streamed answer, as SSE bytes: a request's outputs as they grow, its end, or the
    error that cut it short (after the headers are out, the stream is the only way to say)."""

    def events(self, out: RequestOutput) -> Iterable[bytes]: ...
    def end(self, last: RequestOutput) -> Iterable[bytes]: ...
    def failure(self, message: str, code: str) -> Iterable[bytes]: ...


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    error: Callable[[ProtocolError], tuple[dict, int]]          # -> (body, status)
    respond: Callable[[GenRequest, RequestOutput, Answering], dict]
    stream: Callable[[GenRequest, Answering], Stream]


def sse(obj: Any, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + dumps(obj) + b"\n\n"


# ------------------------------------------------------------------ OpenAI

class _OpenAIStream:
    def __init__(self, req: GenRequest, a: Answering) -> None:
        self.req, self.streamer = req, OpenAIStreamer(req, a.texts)

    def events(self, out: RequestOutput) -> Iterable[bytes]:
        return [sse(c) for c in self.streamer.chunks(out)]

    def end(self, last: RequestOutput) -> Iterable[bytes]:
        usage = [sse(self.streamer.usage_chunk(last))] if self.req.include_usage else []
        return usage + [b"data: [DONE]\n\n"]

    def failure(self, message: str, code: str) -> Iterable[bytes]:
        return [sse(openai_error_body(message, "server_error", None, code)), b"data: [DONE]\n\n"]


def _openai_error(e: ProtocolError) -> tuple[dict, int]:
    return openai_error_body(e.message, e.err_type, e.param, e.code), e.status


def _openai_respond(req: GenRequest, out: RequestOutput, a: Answering) -> dict:
    return (chat_response if req.kind == "chat" else completion_response)(req, out, a.texts)


OPENAI = Dialect("openai", _openai_error, _openai_respond, _OpenAIStream)


# ------------------------------------------------------------------ TGI

class _TGIStream:
    def __init__(self, req: GenRequest, a: Answering) -> None:
        self.streamer = TGIStreamer(req, a.texts, set(a.eos_token_ids))

    def events(self, out: RequestOutput) -> Iterable[bytes]:
        return [sse(ev) for ev in self.streamer.events(out)]

    def end(self, last: RequestOutput) -> Iterable[bytes]:
        return []

    def failure(self, message: str, code: str) -> Iterable[bytes]:
        return [sse(tgi_error_body(message, "generation"))]


def _tgi_error(e: ProtocolError) -> tuple[dict, int]:
    kind = {401: "authentication", 500: "generation", 503: "overloaded"}.get(e.status, "validation")
    # TGI answers every bad input with 422; a bad Host (code invalid_host) is no bad input
    status = 422 if e.status == 400 and e.code != "invalid_host" else e.status
    return tgi_error_body(e.message, kind), status


TGI = Dialect("tgi", _tgi_error,
              lambda req, out, a: tgi_response(req, out, a.texts, set(a.eos_token_ids)), _TGIStream)

"""What a hostile client or web page meets before any route runs.

- ``HostGuard`` (ASGI middleware): a ``Host`` header outside the allow-list gets 400, so
  a page on a rebound DNS name (``evil.example`` -> 127.0.0.1) cannot reach a key-less
  loopback server. ``default_allowed_hosts`` gives the loopback names when bound to
  loopback.
- ``require_json``: POST bodies must be ``application/json`` (415 otherwise). A browser
  sends ``text/plain`` or form bodies cross-origin without a CORS preflight; JSON needs one,
  which fails unless ``--allowed-origins`` names the page's origin.
- ``guarded_h11_protocol``: uvicorn's h11 protocol with a read deadline. uvicorn times out
  idle keep-alive connections but not a request whose headers never finish, nor one whose
  body stops short of its Content-Length; such a connection gets 408 and is closed.
  The app's own body read (``serving.app.read_body``) has the same deadline and answers 408
  in the API's error shape; the protocol's is the backstop for bodies no route reads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Iterable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.errors import ProtocolError, openai_error_body
from serving.fields import short

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_READ_TIMEOUT_S = 30.0
# A body the app is reading has its own deadline (read_body); the protocol closes the
# connection only this much later, so the app's 408 in the API's shape goes out first.
_BACKSTOP_GRACE_S = 1.0


# ------------------------------------------------------------------ Host allow-list

def is_loopback(host: str) -> bool:
    return host.strip("[]").lower() in LOOPBACK_HOSTS or host.startswith("127.")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """Loopback names for a loopback bind; None (no check) for any other bind address,
    whose public names only the operator knows (``--allowed-hosts``)."""
    return LOOPBACK_HOSTS if is_loopback(bind_host) else None


def host_name(value: str) -> str:
    """``Host`` header value -> the name without port or IPv6 brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


class HostGuard:
    """Reject requests whose ``Host`` is not in ``allowed`` ("*" allows any)."""

    def __init__(self, app: Any, allowed: Iterable[str],
                 reject: Callable[[dict, str], Awaitable[Any] | Any]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(h) for h in allowed)
        self.any = "*" in self.allowed
        self.reject = reject            # (scope, message) -> ASGI response

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.any:
            return await self.app(scope, receive, send)
        raw = next((v for k, v in scope["headers"] if k == b"host"), None)
        if raw is None:
            msg = "missing Host header"
        else:
            name = host_name(raw.decode("latin-1"))
            if name in self.allowed:
                return await self.app(scope, receive, send)
            msg = (f"Host {short(name)} is not allowed on this server "
                   f"(start it with --allowed-hosts to add names)")
        response = self.reject(scope, msg)
        await response(scope, receive, send)


# ------------------------------------------------------------------ content type

def require_json(content_type: str | None) -> None:
    """Raise 415 unless the media type is application/json (parameters such as charset allowed)."""
    media = (content_type or "").partition(";")[0].strip().lower()
    if media != "application/json":
        got = f"'{short(media)}'" if media else "none"
        raise ProtocolError(f"Content-Type must be application/json (got {got})",
                              status=415, code="unsupported_media_type")


# ------------------------------------------------------------------ read deadline

def _timeout_response() -> bytes:
    body = json.dumps(openai_error_body("the request was not received in full within the read timeout",
                                          "invalid_request_error", None, "request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _GuardedH11Protocol(H11Protocol):
    """Starts a deadline when a request's first byte arrives (or the connection opens) and
    clears it once the whole request has been received."""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _in_body = False                                 # the deadline is the body's backstop

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.read_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(self.read_timeout_s)          # the first byte of a keep-alive request
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def _update(self) -> None:
        state = self.conn.their_state
        if state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()                           # the request is in (or the connection over)
        elif state is h11.SEND_BODY and self._deadline is not None and not self._in_body:
            self._in_body = True                     # headers done: the body's backstop
            self._arm(self.read_timeout_s + _BACKSTOP_GRACE_S)
        elif state is h11.IDLE and self.cycle is not None and self.cycle.response_complete:
            if self.conn.trailing_data[0]:           # part of a pipelined next request is in
                if self._deadline is None:
                    self._arm(self.read_timeout_s)
            else:
                self._disarm()                       # idle between requests: keep-alive's job

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.conn.their_state is not h11.SEND_BODY:
            self._in_body = False

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response())
        if cycle is not None:                        # the app sees a disconnect; its late sends drop
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def guarded_h11_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a ``read_timeout_s`` deadline on each request."""
    if not read_timeout_s > 0:
        raise ValueError(f"read timeout: expected seconds > 0, got {read_timeout_s!r}")
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"read_timeout_s": float(read_timeout_s)})

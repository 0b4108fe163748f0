"""Client errors: ``ProtocolError`` and the APIs' error bodies (OpenAI's, TGI's, Anthropic's)."""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """A client error to answer with ``status`` and an error body naming ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.err_type = err_type or _default_type(status)
        self.headers = headers or {}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def openai_error_body(message: str, err_type: str, param: str | None = None,
                      code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def tgi_error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def anthropic_error_body(message: str, err_type: str) -> dict:
    return {"type": "error", "error": {"type": err_type, "message": message}}


def bad(param: str, msg: str, **kw: Any) -> ProtocolError:
    return ProtocolError(f"{param}: {msg}", param=param, **kw)

"""The Starlette app: OpenAI-compatible and TGI-compatible routes, health and metrics.

Routes:
  POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}]   (OpenAI)
  POST /v1/responses, GET / DELETE /v1/responses/{id}                        (OpenAI Responses)
  POST /tokenize, POST /detokenize                                           (vLLM's)
  POST /generate, POST /generate_stream, GET /info                           (TGI)
  POST /v1/messages, POST /v1/messages/count_tokens                          (Anthropic)
  GET /health (200 only when the engine is warm and alive), GET /metrics     (Prometheus)
  GET /openapi.json                                                          (request schemas)
  GET / and /static/* (the chat page, serving/web/)

Every generation request follows one path: read the body (size-capped), parse and
validate it into a ``GenRequest`` (serving/openai_request.py, tgi_request.py,
anthropic_request.py), then drive
``engine.generate``. The first output is awaited before any response header is sent, so
errors the engine raises up front (bad input, queue full) still become clean 4xx / 503
answers, streaming or not. While the engine works, the client's connection is watched
(an ``http.disconnect`` from ``receive()``, raced against the generator, no polling): a
client that goes away has its request aborted, which frees its KV pages.

Status codes: 400 bad input (422 on TGI routes, as TGI does; every error on a TGI route
comes in TGI's ``{"error", "error_type"}`` shape, on Anthropic routes in Anthropic's) or a
``Host`` outside the allow-list, 401 missing/wrong API key (``Authorization: Bearer`` or
``x-api-key``), 404 an unknown model on Anthropic routes, 404/405 unknown route or method, 408 body not received within the
read timeout, 413 body too large, 415 POST body not ``application/json``, 503 queue full /
engine not ready or dead, or admission control's refusal (with Retry-After). serving/guard.py says why the Host, content
type and read-timeout checks exist. A 500 means a bug in this server: it is logged and counted in
``state.internal_errors``, which the tests assert stays at zero for hostile input.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.lora import allowed_dirs
from jaxinfer.errors import EngineDeadError, QueueFullError, RequestFailedError
from serving import guard
from serving import lora_routes
from serving import anthropic_request
from serving.anthropic_response import ANTHROPIC
from serving import tokenize_routes
from serving.dialect import OPENAI, TGI, Answering, Dialect, sse
from serving.errors import ProtocolError
from serving.fields import MAX_STOP, Limits, short
from serving.jsonio import dumps, parse_json_body
from serving.openai_request import parse_chat_request, parse_completion_request
from serving.openapi import openapi_schema
from serving.reasoning import reasoning_parser as reasoning_parser_for
from serving.request import GenRequest
from serving.responses_request import MAX_ID_CHARS, parse_responses_request
from serving.responses_response import responses_dialect
from serving.responses_store import ResponseStore
from serving.tgi_request import parse_tgi_request
from serving.token_texts import TokenTexts
from serving.metrics import CONTENT_TYPE, RequestTracker, ServingMetrics

log = logging.getLogger("jaxinfer.serving")

DEFAULT_MAX_BODY_BYTES = 1 << 20
WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")   # the chat page
# The page loads only its own script and style and talks only to this server.
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                 "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
DEFAULT_MAX_N = 16
# A body over the limit is still read (and thrown away) up to this many times the limit, so
# the client gets to read our 413 instead of a connection reset while it is still sending.
_DRAIN_FACTOR = 8


class EngineLike(Protocol):
    """What the server needs from ``jaxinfer.engine.async_engine.AsyncEngine``."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    max_num_seqs: int
    is_ready: bool
    is_dead: bool

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, request_id: str) -> None: ...
    def stats(self) -> dict: ...
    async def shutdown(self) -> None: ...


EngineFactory = Callable[[], "EngineLike | Awaitable[EngineLike]"]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class ServerState:
    """Everything the routes share; lives at ``app.state.jx``."""

    engine: EngineLike | None
    engine_factory: EngineFactory | None = None
    served_model_names: tuple[str, ...] | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_n: int = DEFAULT_MAX_N
    read_timeout_s: float = guard.DEFAULT_READ_TIMEOUT_S
    retry_after_s: int = 1
    shutdown_engine: bool = True
    engine_shutdown_timeout: float = 10.0
    on_ready: Callable[[], None] | None = None                  # engine available (loaded)
    on_load_error: Callable[[BaseException], None] | None = None
    tracing: Any = None          # serving.tracing.RequestTracing when traces are exported
    lora_dirs: tuple[str, ...] = ()   # real paths /v1/load_lora_adapter may read (lora.allowed_dirs)
    reasoning_parser: str | None = None   # --reasoning-parser: serving/reasoning.py's name
    responses: ResponseStore = field(default_factory=ResponseStore)   # /v1/responses' stored answers
    internal_errors: int = 0
    load_error: str | None = None
    load_task: asyncio.Task | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    metrics: ServingMetrics = field(init=False)
    responses_dialect: Dialect = field(init=False)
    _limits: Limits | None = field(default=None, init=False)
    _texts: TokenTexts | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.metrics = ServingMetrics(lambda: self.engine, self.metric_model_name)
        self.responses_dialect = responses_dialect(self.responses)

    # -------------------------------------------------------------- engine access

    def model_names(self) -> tuple[str, ...]:
        if self.served_model_names:
            return self.served_model_names
        return (self.engine.model_name,) if self.engine is not None else ()

    def all_model_names(self) -> tuple[str, ...]:
        """The base model's names and the loaded LoRA adapters' (serving/lora_routes.py)."""
        return self.model_names() + lora_routes.adapter_names(self.engine)

    def metric_model_name(self) -> str:
        names = self.model_names()
        return names[0] if names else ""

    def ready_engine(self) -> EngineLike:
        e = self.engine
        retry = {"Retry-After": str(self.retry_after_s)}
        if e is None:
            # The load error's text (paths, library messages) stays in the server log.
            msg = ("the engine failed to load; see the server log" if self.load_error
                   else "the model is still loading; retry shortly")
            raise ProtocolError(msg, status=503, code="not_ready", headers=retry)
        if e.is_dead:
            raise ProtocolError("the engine has stopped; this server cannot serve requests",
                                  status=503, code="engine_dead")
        if not e.is_ready:
            raise ProtocolError("the engine is warming up; retry shortly", status=503,
                                  code="not_ready", headers=retry)
        return e

    def limits(self, engine: EngineLike) -> Limits:
        if self._limits is None:
            tok = engine.tokenizer
            try:
                vocab = len(tok)
            except TypeError:
                vocab = getattr(tok, "vocab_size", None)
            self._limits = Limits(self.model_names(), int(engine.max_model_len),
                                    max(1, min(self.max_n, int(engine.max_num_seqs))), vocab,
                                    reasoning_parser=self.reasoning_parser)
        names = self.all_model_names()
        if names != self._limits.model_names:       # adapters were loaded or unloaded
            self._limits = dataclasses.replace(self._limits, model_names=names)
        return self._limits

    def texts(self, engine: EngineLike) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(engine.tokenizer)
        return self._texts

    async def load(self) -> None:
        try:
            f = self.engine_factory
            if inspect.iscoroutinefunction(f):
                engine = await f()
            else:   # a blocking load / warm-up runs off the loop so /health keeps answering
                engine = await _in_daemon_thread(f)
                if inspect.isawaitable(engine):
                    engine = await engine
            self.engine = engine
            log.info("engine loaded: serving %s", ", ".join(self.model_names()))
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("engine failed to load")
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        if self.on_ready is not None:
            self.on_ready()

    # -------------------------------------------------------------- auth

    def check_auth(self, request: Request) -> None:
        """The key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key``
        (Anthropic's); both compared in constant time, both always."""
        if not self.api_key:
            return
        key = self.api_key.encode()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip().encode() if scheme.lower() == "bearer" else b""
        x_key = request.headers.get("x-api-key", "").strip().encode()
        if not (hmac.compare_digest(bearer, key) | hmac.compare_digest(x_key, key)):
            raise ProtocolError("missing or invalid API key: send 'Authorization: Bearer <key>' "
                                  "or 'x-api-key: <key>'", status=401, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a daemon thread: unlike the default executor, a shutdown (Ctrl-C while
    the model compiles) does not have to wait for it to finish."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def work() -> None:
        try:
            res, ok = fn(), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            res, ok = e, False
        with contextlib.suppress(RuntimeError):   # the loop is already closed: nobody waits
            loop.call_soon_threadsafe(settle, ok, res)

    threading.Thread(target=work, name="jaxinfer-engine-load", daemon=True).start()
    return await fut


# ------------------------------------------------------------------ responses

def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status_code=status, headers=headers, media_type="application/json")


# Routes that answer in another API's error shape than OpenAI's, also for errors raised
# before a handler runs (404, 405, a bad Host).
PATH_DIALECTS: dict[str, Dialect] = {"/generate": TGI, "/generate_stream": TGI, "/info": TGI,
                                     "/v1/messages": ANTHROPIC, "/v1/messages/count_tokens": ANTHROPIC}


def dialect_of(path: str) -> Dialect:
    return PATH_DIALECTS.get(path, OPENAI)


def error_response(e: ProtocolError, dialect: Dialect = OPENAI) -> Response:
    body, status = dialect.error(e)
    return json_response(body, status, e.headers)


class SSEResponse:
    """Streams server-sent events while watching for the client to go away.

    Whichever ends first, the body or the connection, the other is cancelled; then the body
    generator is closed and ``on_close`` runs (it closes the engine's generator, which
    aborts the request if it had not finished), whatever happened, even if the body never
    started.
    """

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.body = body
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        pump = watch = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(wait_disconnect(receive))
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        except OSError:      # the client is gone (ASGI 2.4 servers raise from send)
            pass
        finally:
            tasks = [t for t in (pump, watch) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body.aclose()
            if self.on_close is not None:
                await self.on_close()

    async def _pump(self, send: Any) -> None:
        async for chunk in self.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, coro: Awaitable[Any]) -> Any:
    """Await ``coro`` unless the client disconnects first (then cancel it, raise ClientGone)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    gone = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():      # the client left (or we are being cancelled ourselves)
            gone = True
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if gone:
        raise ClientGone()
    return task.result()


async def read_body(request: Request, limit: int, timeout_s: float = guard.DEFAULT_READ_TIMEOUT_S) -> bytes:
    """The body, at most ``limit`` bytes (413), received in full within ``timeout_s`` (408)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise ProtocolError(f"the request body was not received in full within {timeout_s:g} s",
                              status=408, code="request_timeout",
                              headers={"Connection": "close"}) from None


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = ProtocolError(f"request body is larger than the limit of {limit} bytes",
                              status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit * _DRAIN_FACTOR:
                raise too_big
            if size <= limit:
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    if size > limit:
        raise too_big
    return b"".join(chunks)


async def close_gen(gen: Any) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


# ------------------------------------------------------------------ generation

async def _first_output(gen: Any) -> RequestOutput:
    """The engine's first output; its up-front ValueError (bad input) becomes a 4xx."""
    try:
        return await gen.__anext__()
    except ValueError as e:
        msg = str(e)
        head, sep, _ = msg.partition(":")
        param = head if sep and head.replace("_", "").replace(".", "").isalnum() else None
        raise ProtocolError(msg, param=param, status=400) from None
    except StopAsyncIteration:
        raise RuntimeError("engine.generate ended without any output") from None


async def _collect(gen: Any, first: RequestOutput, tracker: RequestTracker) -> RequestOutput:
    last = first
    tracker.update(first)
    # Run the generator to its end rather than stopping at ``finished``: closing it early,
    # even just after the last output, would look like a client abort to the engine.
    async for out in gen:
        last = out
        tracker.update(out)
    return last


def _trace_hook(st: ServerState, request: Request, req: GenRequest,
                received: float) -> Callable[[RequestOutput | None, bool], None] | None:
    tracing = st.tracing
    if tracing is None:
        return None
    name = f"{request.method} {request.url.path}"
    return lambda out, aborted: tracing.record(
        name=name, headers=request.headers, model=req.model or st.metric_model_name(),
        request_id=req.request_id, received=received, out=out, aborted=aborted)


async def run_generation(request: Request, st: ServerState, engine: EngineLike,
                         req: GenRequest, dialect: Dialect, received: float | None = None) -> Response:
    received = time.monotonic() if received is None else received
    tracker = st.metrics.tracker(_trace_hook(st, request, req, received))
    # a name that is not the base model's is a LoRA adapter's (the parser checked it is served)
    lora = {} if req.model in st.model_names() else {"lora": req.model}
    extra = {**lora, **({"priority": req.priority} if req.priority else {})}
    gen = engine.generate(req.prompt_ids, req.params, req.request_id, **extra)
    try:
        first = await race_disconnect(request, _first_output(gen))
    except BaseException as e:
        await close_gen(gen)
        if isinstance(e, ClientGone):       # gone before the first output: still an abort
            tracker.finish(None, aborted=True)
        if isinstance(e, QueueFullError):
            st.metrics.rejected.labels(st.metric_model_name(), e.reason).inc()
        raise
    answering = Answering(st.texts(engine), frozenset(engine.tokenizer.eos_token_ids))
    if req.stream:
        body = _stream(st, dialect.stream(req, answering), req, gen, first, tracker)
        return SSEResponse(body, on_close=lambda: close_gen(gen))
    try:
        final = await race_disconnect(request, _collect(gen, first, tracker))
    except ClientGone:
        tracker.finish(None, aborted=True)
        raise
    finally:
        await close_gen(gen)
    tracker.finish(final)
    if not final.finished or any(o.finish_reason == "abort" for o in final.outputs):
        raise ProtocolError("the request was aborted by the server (shutting down?)", status=503,
                              code="aborted", headers={"Retry-After": str(st.retry_after_s)})
    return json_response(dialect.respond(req, final, answering))


async def _outputs(gen: Any, first: RequestOutput) -> AsyncIterator[RequestOutput]:
    """``first``, then the rest of ``gen``, which is run to its end (see ``_collect``)."""
    yield first
    async for out in gen:
        yield out


def _stream_failure(st: ServerState, req: GenRequest, e: Exception) -> tuple[str, str]:
    """After the headers are out, an error can only be reported in the stream: say what."""
    if isinstance(e, EngineDeadError):
        log.error("engine died while streaming request %s: %s", req.request_id, e)
        return "the engine has stopped; this server cannot serve requests", "engine_dead"
    if isinstance(e, RequestFailedError):
        return str(e), "engine_error"
    st.internal_errors += 1
    log.exception("streaming request %s failed", req.request_id)
    return "internal error while streaming", "internal_error"


async def _stream(st: ServerState, stream: Any, req: GenRequest, gen: Any,
                  first: RequestOutput, tracker: RequestTracker) -> AsyncIterator[bytes]:
    """The SSE body of a streamed answer (``stream``: a serving.dialect.Stream)."""
    last, completed = first, False
    try:
        async for out in _outputs(gen, first):
            last = out
            tracker.update(out)
            for chunk in stream.events(out):
                yield chunk
        completed = True
        tracker.finish(last)
        for chunk in stream.end(last):
            yield chunk
    except Exception as e:
        if completed:
            raise
        completed = True
        tracker.finish(last, aborted=True)
        for chunk in stream.failure(*_stream_failure(st, req, e)):
            yield chunk
    finally:
        if not completed:
            tracker.finish(last, aborted=True)
        await close_gen(gen)


# ------------------------------------------------------------------ routes

Handler = Callable[[Request, ServerState], Awaitable[Response]]


def endpoint(handler: Handler, *, dialect: Dialect = OPENAI, auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: auth, then map every failure to a well-formed error response."""

    async def run(request: Request) -> Response:
        st: ServerState = request.app.state.jx
        try:
            if auth:
                st.check_auth(request)
            return await handler(request, st)
        except ProtocolError as e:
            return error_response(e, dialect)
        except QueueFullError as e:
            return error_response(ProtocolError(
                f"the server is at capacity ({e or 'waiting queue full'}); retry later", status=503,
                code="overloaded" if e.reason == "queue_delay" else "queue_full",
                headers={"Retry-After": str(e.retry_after_s or st.retry_after_s)}), dialect)
        except EngineDeadError:
            return error_response(ProtocolError(
                "the engine has stopped; this server cannot serve requests", status=503,
                code="engine_dead"), dialect)
        except RequestFailedError as e:    # its step failed; the engine serves on (logged there)
            return error_response(ProtocolError(str(e), status=500, code="engine_error"), dialect)
        except ClientGone:
            return Response(status_code=499)    # nobody is listening; nginx's "client closed"
        except Exception:
            st.internal_errors += 1
            log.exception("internal error on %s %s", request.method, request.url.path)
            return error_response(ProtocolError("internal server error", status=500,
                                                  code="internal_error"), dialect)

    return run


async def _gen_route(request: Request, st: ServerState, parse: Callable[..., GenRequest],
                     dialect: Dialect = OPENAI) -> Response:
    received = time.monotonic()
    engine = st.ready_engine()
    guard.require_json(request.headers.get("content-type"))
    body = parse_json_body(await read_body(request, st.max_body_bytes, st.read_timeout_s))
    # Tokenizing and chat templating take milliseconds per long prompt: off the event loop.
    req = await asyncio.to_thread(parse, body, st.limits(engine), engine.tokenizer)
    return await run_generation(request, st, engine, req, dialect, received)


async def completions(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, parse_completion_request)


async def chat_completions(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, parse_chat_request)


async def create_response(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, lambda b, lim, tok: parse_responses_request(b, lim, tok, st.responses),
                            st.responses_dialect)


def _no_response(rid: str) -> ProtocolError:
    return ProtocolError(f"no stored response with id {short(rid, 60)}", param="response_id", status=404,
                         code="response_not_found", err_type="invalid_request_error")


async def get_response(request: Request, st: ServerState) -> Response:
    rid = request.path_params["response_id"]
    entry = st.responses.get(rid) if len(rid) <= MAX_ID_CHARS else None
    if entry is None:
        raise _no_response(rid)
    return json_response(entry.response)


async def delete_response(request: Request, st: ServerState) -> Response:
    rid = request.path_params["response_id"]
    if len(rid) > MAX_ID_CHARS or not st.responses.delete(rid):
        raise _no_response(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


async def tgi_generate(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, lambda b, lim, tok: parse_tgi_request(b, lim, tok, stream=False), TGI)


async def tgi_generate_stream(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, lambda b, lim, tok: parse_tgi_request(b, lim, tok, stream=True), TGI)


async def messages(request: Request, st: ServerState) -> Response:
    return await _gen_route(request, st, anthropic_request.parse_messages_request, ANTHROPIC)


async def count_tokens(request: Request, st: ServerState) -> Response:
    engine = st.ready_engine()
    guard.require_json(request.headers.get("content-type"))
    body = parse_json_body(await read_body(request, st.max_body_bytes, st.read_timeout_s))
    return json_response(await asyncio.to_thread(anthropic_request.count_tokens, body, st.limits(engine),
                                                 engine.tokenizer))


def _model_card(st: ServerState, name: str, parent: str | None = None) -> dict:
    """``parent``: the base model of a LoRA adapter's card (as vLLM lists adapters)."""
    e = st.engine
    return {"id": name, "object": "model", "created": st.started, "owned_by": "jaxinfer", "root": name,
            "parent": parent, "max_model_len": e.max_model_len if e is not None else None}


async def load_lora_adapter(request: Request, st: ServerState) -> Response:
    return await _lora_route(request, st, lora_routes.load_lora_adapter)


async def unload_lora_adapter(request: Request, st: ServerState) -> Response:
    return await _lora_route(request, st, lora_routes.unload_lora_adapter)


async def tokenize(request: Request, st: ServerState) -> Response:
    return await _tokenizer_route(request, st, tokenize_routes.tokenize)


async def detokenize(request: Request, st: ServerState) -> Response:
    return await _tokenizer_route(request, st, tokenize_routes.detokenize)


async def _tokenizer_route(request: Request, st: ServerState, handler: Callable[..., dict]) -> Response:
    """/tokenize, /detokenize (serving/tokenize_routes.py): no engine step, only its tokenizer."""
    engine = st.ready_engine()
    guard.require_json(request.headers.get("content-type"))
    body = parse_json_body(await read_body(request, st.max_body_bytes, st.read_timeout_s))
    return json_response(await asyncio.to_thread(handler, body, st.limits(engine), engine.tokenizer))


async def _lora_route(request: Request, st: ServerState, handler: Callable[..., Awaitable[Response]]) -> Response:
    engine = st.ready_engine()
    guard.require_json(request.headers.get("content-type"))
    limit = min(st.max_body_bytes, lora_routes.MAX_BODY_BYTES)
    return await handler(st, engine, parse_json_body(await read_body(request, limit, st.read_timeout_s)))


async def list_models(request: Request, st: ServerState) -> Response:
    cards = [_model_card(st, n) for n in st.model_names()]
    cards += [_model_card(st, n, parent=st.metric_model_name()) for n in lora_routes.adapter_names(st.engine)]
    return json_response({"object": "list", "data": cards})


async def get_model(request: Request, st: ServerState) -> Response:
    name = request.path_params["model"]
    if name not in st.all_model_names():
        raise ProtocolError(f"model: {short(name)} is not served here", param="model", status=404,
                              code="model_not_found")
    base = name in st.model_names()
    return json_response(_model_card(st, name, parent=None if base else st.metric_model_name()))


async def tgi_info(request: Request, st: ServerState) -> Response:
    e = st.ready_engine()
    return json_response({"model_id": st.metric_model_name(), "model_dtype": None,
                          "max_concurrent_requests": e.max_num_seqs, "max_best_of": 1,
                          "max_stop_sequences": MAX_STOP, "max_input_tokens": e.max_model_len - 1,
                          "max_total_tokens": e.max_model_len, "router": "jaxinfer", "version": "0.1.0"})


async def health(request: Request, st: ServerState) -> Response:
    e = st.engine
    if e is None:
        status = "failed" if st.load_error else "loading"
    elif e.is_dead:
        status = "dead"
    elif not e.is_ready:
        status = "warming_up"
    else:
        # Serving. "warming": some step shapes still compile in the background (a request
        # may wait for one); "ready": all compiled.
        get = getattr(e, "warmup_status", None)
        w = get() if get is not None else None
        if w and not w.get("warm", True):
            return json_response({"status": "warming", "buckets_compiled": w["buckets_compiled"],
                                  "buckets_total": w["buckets_total"]})
        return json_response({"status": "ready"})
    return json_response({"status": status}, 503)   # why it failed: the server log


async def metrics(request: Request, st: ServerState) -> Response:
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


async def openapi(request: Request, st: ServerState) -> Response:
    return json_response(openapi_schema())


async def chat_page(request: Request, st: ServerState) -> Response:
    """The chat page (serving/web/); it asks for the API key itself when the server has one."""
    return FileResponse(os.path.join(WEB_DIR, "index.html"), headers=_PAGE_HEADERS)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    if status == 404:
        detail = f"no route for {request.method} {request.url.path}"
    elif status == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(ProtocolError(detail, status=status, code=str(status),
                                          headers=getattr(exc, "headers", None) or None),
                          dialect_of(request.url.path))


async def _unhandled(request: Request, exc: Exception) -> Response:
    st: ServerState = request.app.state.jx
    st.internal_errors += 1
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ProtocolError("internal server error", status=500, code="internal_error"),
                          dialect_of(request.url.path))


def build_app(engine: EngineLike | None = None, *, engine_factory: EngineFactory | None = None,
              served_model_names: list[str] | tuple[str, ...] | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_n: int = DEFAULT_MAX_N,
              retry_after_s: int = 1, shutdown_engine: bool = True,
              engine_shutdown_timeout: float = 10.0, on_ready: Callable[[], None] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None,
              tracing: Any = None, allowed_hosts: Iterable[str] | None = None,
              allowed_origins: Iterable[str] | None = None,
              read_timeout_s: float = guard.DEFAULT_READ_TIMEOUT_S,
              lora_dirs: Iterable[str] = (), reasoning_parser: str | None = None,
              response_store: ResponseStore | None = None) -> Starlette:
    """The ASGI app around ``engine`` (ready now) or ``engine_factory`` (loaded at startup).

    A factory is called once the server is listening, so /health can answer 503 while the
    model loads and warms up: a coroutine function is awaited on the loop, a plain
    function runs in a worker thread (it may return an awaitable, which is then awaited).
    ``on_ready`` is called once the engine is there (at startup, or when the factory
    returns); ``on_load_error`` if the factory raises. ``tracing``: a
    ``serving.tracing.RequestTracing`` (shut down with the app), or None for no traces.
    ``allowed_hosts``: the ``Host`` names served ("*": any; None: no check; the server passes
    the loopback names for a loopback bind). ``allowed_origins``: web origins allowed by
    CORS (None: no CORS headers, so browsers keep other origins out). ``read_timeout_s``:
    a request body must arrive in full within it (else 408). ``lora_dirs``: the directories
    /v1/load_lora_adapter may load adapters from (none: loading by path is refused).
    ``reasoning_parser``: split chat replies' thinking off (a name in
    ``serving.reasoning.PARSER_NAMES``; None: replies are all content).
    ``response_store``: where /v1/responses keeps its answers (default: a ``ResponseStore``
    with its default bounds, serving/responses_store.py).
    """
    if (engine is None) == (engine_factory is None):
        raise ValueError("build_app: pass exactly one of engine, engine_factory")
    reasoning_parser_for(reasoning_parser)     # an unknown name fails here, not on a request
    st = ServerState(engine=engine, engine_factory=engine_factory,
                     served_model_names=tuple(served_model_names) if served_model_names else None,
                     api_key=api_key or None, max_body_bytes=max_body_bytes, max_n=max_n,
                     retry_after_s=retry_after_s, shutdown_engine=shutdown_engine,
                     engine_shutdown_timeout=engine_shutdown_timeout, on_ready=on_ready,
                     on_load_error=on_load_error, tracing=tracing, read_timeout_s=read_timeout_s,
                     lora_dirs=allowed_dirs(lora_dirs), reasoning_parser=reasoning_parser,
                     **({} if response_store is None else {"responses": response_store}))
    app = Starlette(routes=_routes(), lifespan=_lifespan(st),
                    middleware=_middleware(allowed_hosts, allowed_origins),
                    exception_handlers={HTTPException: _http_error, Exception: _unhandled})
    app.state.jx = st
    return app


def _lifespan(st: ServerState) -> Callable[[Starlette], Any]:
    """The app's lifespan: the engine loaded (a factory's, in the background) or ready;
    at shutdown the load cancelled, the engine shut down and the traces flushed."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if st.engine is None and st.engine_factory is not None:
            st.load_task = asyncio.create_task(st.load())
        elif st.on_ready is not None:
            st.on_ready()
        try:
            yield
        finally:
            if st.load_task is not None and not st.load_task.done():
                st.load_task.cancel()
                await asyncio.gather(st.load_task, return_exceptions=True)
            if st.shutdown_engine and st.engine is not None:
                try:
                    await asyncio.wait_for(st.engine.shutdown(), st.engine_shutdown_timeout)
                except Exception:
                    log.exception("engine shutdown failed")
            if st.tracing is not None:      # flush the spans still batched
                await asyncio.to_thread(st.tracing.shutdown)

    return lifespan


def _routes() -> list[Any]:
    """The API's routes: OpenAI's (completions, chat, Responses), LoRA admin, TGI's, Anthropic's,
    health, metrics, the schema and the chat page."""
    return [
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/responses", endpoint(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoint(get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", endpoint(delete_response), methods=["DELETE"]),
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/load_lora_adapter", endpoint(load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", endpoint(unload_lora_adapter), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/generate", endpoint(tgi_generate, dialect=TGI), methods=["POST"]),
        Route("/generate_stream", endpoint(tgi_generate_stream, dialect=TGI), methods=["POST"]),
        Route("/info", endpoint(tgi_info, dialect=TGI), methods=["GET"]),
        Route("/v1/messages", endpoint(messages, dialect=ANTHROPIC), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(count_tokens, dialect=ANTHROPIC), methods=["POST"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics, auth=False), methods=["GET"]),
        Route("/openapi.json", endpoint(openapi, auth=False), methods=["GET"]),
        Route("/", endpoint(chat_page, auth=False), methods=["GET"]),
        Mount("/static", StaticFiles(directory=WEB_DIR), name="static"),
    ]


def _reject_host(scope: dict, message: str) -> Response:
    return error_response(ProtocolError(message, status=400, code="invalid_host"), dialect_of(scope.get("path", "")))


def _middleware(allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str] | None) -> list[Middleware]:
    """Host check first (a rebound name gets nothing, not even a CORS preflight), then CORS."""
    stack = []
    if allowed_hosts is not None:
        stack.append(Middleware(guard.HostGuard, allowed=tuple(allowed_hosts), reject=_reject_host))
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                allow_methods=["GET", "POST"],
                                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
                                max_age=600))
    return stack

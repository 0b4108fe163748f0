"""Run the serving app under uvicorn, with a graceful SIGTERM.

The CLI wires ``jaxinfer serve`` as::

    from serving.server import add_serve_args, serve_main
    add_engine_args(serve_parser)         # the CLI's own: --model --max-num-seqs --max-model-len ...
    add_serve_args(serve_parser)          # --host --port --api-key --served-model-name ...
    ...
    return serve_main(args)               # builds Engine + AsyncEngine from args while listening
    return serve_main(args, engine)       # or: serve a ready AsyncEngine / a zero-argument factory

While the engine loads and compiles, the server already listens and /health answers 503;
it answers 200 once the engine is warm. If loading fails the server exits with status 1, and
so it does if the engine loop dies later (AsyncEngine.on_death): /health answers "dead"
until the process is gone.

On SIGTERM (or Ctrl-C) the server stops accepting connections, lets in-flight requests
finish for up to ``--shutdown-timeout`` seconds, cancels what is left (which aborts those
requests in the engine), shuts the engine down, and returns 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import uvicorn

from serving.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, build_app
from serving.guard import DEFAULT_READ_TIMEOUT_S, default_allowed_hosts, guarded_h11_protocol, is_loopback
from serving.reasoning import PARSER_NAMES

log = logging.getLogger("jaxinfer.serving")

DEFAULT_SERVE_MAX_SEQS = 32    # --max-num-seqs when the CLI leaves it unset (generate uses 1)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP server's options (the model / engine options are the CLI's own)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: loopback only; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on the /v1 and TGI routes "
                        "(visible in `ps`: prefer --api-key-file or $JAXINFER_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line)")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header names served, else 400 ('*': any; default: the loopback names "
                        "when bound to loopback, any otherwise)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="web origins allowed to call the API from a browser (CORS), e.g. "
                        "https://app.example.com ('*': any; default: none)")
    g.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                   help="a request's headers and body must arrive within this, else 408 "
                        f"(default {DEFAULT_READ_TIMEOUT_S:g})")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the engine's model name)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help=f"largest n (samples per request), also capped by max_num_seqs (default {DEFAULT_MAX_N})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    g.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export a trace per request over OTLP/HTTP to URL "
                        "(e.g. http://localhost:4318/v1/traces); default: no tracing")
    g.add_argument("--otlp-service-name", default="jaxinfer",
                   help="service.name of the exported traces (default jaxinfer)")
    g.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                   help="repeatable: POST /v1/load_lora_adapter may load adapters from directories "
                        "under DIR (its lora_path resolved, symlinks and '..' included, must lie "
                        "inside one; a relative lora_path is taken under the first DIR). Without it "
                        "loading over HTTP is refused; --lora-modules adapters load from anywhere")
    g.add_argument("--reasoning-parser", default=None, choices=PARSER_NAMES, metavar="NAME",
                   help="split a thinking model's <think>...</think> off its chat replies into "
                        "reasoning_content (vLLM's names: " + ", ".join(PARSER_NAMES) + "; default: none)")


def serve_main(args: argparse.Namespace, engine: Any = None) -> int:
    """``jaxinfer serve``: serve ``engine`` (an AsyncEngine or a zero-argument factory), or,
    when it is None, the engine the CLI's engine options describe (loaded after listening)."""
    tracing = None
    if getattr(args, "otlp_traces_endpoint", None):   # imported only when asked for
        from serving.tracing import RequestTracing

        tracing = RequestTracing(args.otlp_traces_endpoint, service_name=args.otlp_service_name)
    if engine is None:
        engine = engine_factory_from_args(args)
    return run_server(engine, host=args.host, port=args.port, api_key=args.api_key,
                      served_model_names=args.served_model_name, max_body_bytes=args.max_request_bytes,
                      max_n=args.max_n, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                      access_log=not args.no_access_log, tracing=tracing,
                      allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                      read_timeout_s=args.read_timeout, lora_dirs=getattr(args, "lora_dir", ()),
                      reasoning_parser=getattr(args, "reasoning_parser", None))


def engine_factory_from_args(args: argparse.Namespace) -> Callable[[], Any]:
    """A factory for the AsyncEngine the CLI's engine flags (``add_engine_args``) describe."""

    def load() -> Any:
        from jaxinfer.engine_args import engine_config
        from jaxinfer.engine.async_engine import AsyncEngine
        from jaxinfer.engine.engine import Engine

        t0 = time.perf_counter()
        print("jaxinfer: loading model and compiling buckets ...", file=sys.stderr, flush=True)
        engine = Engine(args.model, config=engine_config(args, default_max_seqs=DEFAULT_SERVE_MAX_SEQS,
                                                         default_warmup="background"), progress=True)
        w = engine.warmup_status()
        rest = "" if w["warm"] else (f"; {w['buckets_total'] - w['buckets_compiled']} more step shapes "
                                     "compile in the background (/health: warming)")
        print(f"jaxinfer: engine ready in {time.perf_counter() - t0:.1f}s{rest}", file=sys.stderr, flush=True)
        return AsyncEngine(engine)

    return load


def run_server(engine: Any, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_names: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_n: int = DEFAULT_MAX_N, shutdown_timeout: float = 30.0, log_level: str = "info",
               access_log: bool = True, sock: socket.socket | None = None, tracing: Any = None,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None,
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, lora_dirs: Iterable[str] = (),
               reasoning_parser: str | None = None) -> int:
    """Serve until SIGTERM / SIGINT; return 0 after a graceful shutdown.

    ``allowed_hosts`` None: the loopback names when bound to loopback, else any Host.
    ``lora_dirs``: where /v1/load_lora_adapter may load adapters from (build_app).
    ``reasoning_parser``: serving/reasoning.py's parser for chat replies (build_app).

    ``engine`` is either ready (has ``generate``) or a zero-argument factory called after
    the server starts listening (then /health answers 503 until it returns a warm engine).
    """
    is_engine = hasattr(engine, "generate")
    if not is_engine and not callable(engine):
        raise TypeError("run_server: engine must be an AsyncEngine or a zero-argument factory")
    failed: list[BaseException] = []
    if sock is not None:
        host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def on_ready() -> None:
        names = ", ".join(app.state.jx.model_names())
        print(f"jaxinfer: serving {names} at {url} (OpenAI API under {url}/v1)", file=sys.stderr, flush=True)
        watch = getattr(app.state.jx.engine, "on_death", None)
        if watch is not None:
            watch(on_engine_dead)

    def on_engine_dead(e: BaseException) -> None:
        # A dead engine is not a live server: exit non-zero (after uvicorn's graceful stop,
        # whose in-flight requests the engine has already failed) so a supervisor restarts it.
        failed.append(e)
        print(f"jaxinfer: the engine has stopped ({type(e).__name__}: {e}); exiting", file=sys.stderr, flush=True)
        server.should_exit = True

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        print(f"jaxinfer: the engine failed to load: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        server.should_exit = True

    app = build_app(engine if is_engine else None, engine_factory=None if is_engine else engine,
                    served_model_names=served_model_names, api_key=api_key,
                    max_body_bytes=max_body_bytes, max_n=max_n, on_ready=on_ready,
                    on_load_error=on_load_error, tracing=tracing,
                    allowed_hosts=allowed_hosts if allowed_hosts is not None else default_allowed_hosts(host),
                    allowed_origins=allowed_origins, read_timeout_s=read_timeout_s, lora_dirs=lora_dirs,
                    reasoning_parser=reasoning_parser)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="on", timeout_graceful_shutdown=shutdown_timeout,
                            http=guarded_h11_protocol(read_timeout_s))
    server = uvicorn.Server(config)
    if not is_loopback(host) and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", host)
    with _absorb_reraised_signals():
        server.run(sockets=[sock] if sock is not None else None)
    return 0 if server.started and not failed else 1


@contextlib.contextmanager
def _absorb_reraised_signals() -> Iterator[None]:
    """uvicorn re-raises the SIGTERM it handled once it has shut down, to the handler that was
    installed before it; install a no-op there so a graceful shutdown exits 0, not -15."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

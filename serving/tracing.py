"""OpenTelemetry traces: one span per generation request, with queue / prefill / decode children.

Off by default. ``jaxinfer serve --otlp-traces-endpoint URL`` builds a ``RequestTracing``
that exports over OTLP/HTTP (protobuf) to URL, e.g. ``http://collector:4318/v1/traces``.
When it is off, nothing here is imported by the server (the OpenTelemetry packages are
imported lazily, inside ``RequestTracing``), so a server without tracing pays nothing.

Spans are written when a request ends, from the times the engine already records in
``RequestMetrics`` (``time.monotonic``), so the engine loop does no tracing work at all:

    POST /v1/chat/completions         server receipt -> last output (attributes below)
      ├─ queue                        arrival in the engine -> first scheduled
      ├─ prefill                      first scheduled -> first token
      └─ decode                       first token -> finished

The request span is a child of the caller's span when the request carries a W3C
``traceparent`` header (and ``tracestate``), so a client's trace continues into the server.
Attribute names follow OpenTelemetry's GenAI semantic conventions where one exists.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from jaxinfer.outputs import RequestOutput

DEFAULT_SERVICE_NAME = "jaxinfer"


def _wall_ns(mono: float, offset_ns: int) -> int:
    """A ``time.monotonic()`` reading as Unix-epoch nanoseconds (what OTel spans carry)."""
    return int(mono * 1e9) + offset_ns


class RequestTracing:
    """Owns a TracerProvider; ``record`` writes one request's spans.

    ``exporter``: a SpanExporter to use instead of OTLP/HTTP (tests pass the SDK's
    in-memory one; it is then exported synchronously). With ``endpoint`` spans are batched
    and sent by the SDK's background thread, off the event loop.
    """

    def __init__(self, endpoint: str | None = None, *, service_name: str = DEFAULT_SERVICE_NAME,
                 exporter: Any = None, timeout_s: float = 10.0) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError("--otlp-traces-endpoint needs opentelemetry-sdk and "
                             "opentelemetry-exporter-otlp-proto-http: pip install 'jaxinfer[tracing]'"
                             ) from e

        if (endpoint is None) == (exporter is None):
            raise ValueError("RequestTracing: pass exactly one of endpoint, exporter")
        if endpoint is not None:
            if not endpoint.startswith(("http://", "https://")):
                raise ValueError(f"--otlp-traces-endpoint: expected an http(s):// URL, got {endpoint!r}")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s))
        else:
            processor = SimpleSpanProcessor(exporter)
        # A provider of our own rather than the global one: several servers (tests) can
        # live in one process, and an embedding application keeps its own global provider.
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("jaxinfer.serving")
        self.propagator = TraceContextTextMapPropagator()

    def record(self, *, name: str, headers: Mapping[str, str], model: str, request_id: str,
               received: float, out: RequestOutput | None, aborted: bool,
               ended: float | None = None) -> None:
        """Write the spans of one finished (or aborted) request; times are ``time.monotonic()``."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        offset_ns = time.time_ns() - time.monotonic_ns()
        ended = time.monotonic() if ended is None else ended
        met = out.metrics if out is not None else None
        parent = self.propagator.extract({k: headers[k] for k in ("traceparent", "tracestate")
                                          if k in headers})
        reasons = ["abort"] if aborted or out is None or not out.outputs else \
            [o.finish_reason or "abort" for o in out.outputs]
        attrs: dict[str, Any] = {
            "gen_ai.system": "jaxinfer", "gen_ai.request.model": model,
            "gen_ai.response.finish_reasons": reasons, "jaxinfer.request_id": request_id,
            "gen_ai.usage.input_tokens": len(out.prompt_token_ids) if out is not None else 0,
            "gen_ai.usage.output_tokens": sum(len(o.token_ids) for o in out.outputs) if out else 0,
        }
        root = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                      start_time=_wall_ns(received, offset_ns))
        if met is not None:
            finished = met.finished_time if met.finished_time is not None else ended
            phases = (("queue", met.arrival_time, met.first_scheduled_time),
                      ("prefill", met.first_scheduled_time, met.first_token_time),
                      ("decode", met.first_token_time, finished))
            ctx = _context_with(root)
            for phase, start, end in phases:
                if start is None:
                    break              # aborted before this phase began
                end = ended if end is None else end
                child = self.tracer.start_span(phase, context=ctx, start_time=_wall_ns(start, offset_ns))
                child.end(end_time=_wall_ns(max(start, end), offset_ns))
        if "abort" in reasons:
            root.set_status(Status(StatusCode.ERROR, "aborted"))
        root.end(end_time=_wall_ns(max(received, ended), offset_ns))

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter's thread."""
        self.provider.shutdown()


def _context_with(span: Any) -> Any:
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)

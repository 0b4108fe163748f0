"""OpenTelemetry traces (serving/tracing.py) against the mock engine: the SDK's in-memory
exporter for the span tree and attributes, and a local OTLP/HTTP receiver (a tiny HTTP
server decoding the protobuf export request) for the real exporter."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

import opentelemetry.sdk  # noqa: F401 - required test dependencies
import opentelemetry.exporter.otlp.proto.http  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import MockAsyncEngine, serve_in_thread  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from serving.app import build_app  # noqa: E402
from serving.tracing import RequestTracing  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
# Greedy: with OpenAI's default temperature 1 the mock samples its continuation, which may
# reach its EOS before 5 tokens (the test then flaked on the token count).
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0}


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    engine = MockAsyncEngine(max_model_len=256)
    app = build_app(engine, tracing=RequestTracing(exporter=exporter))
    # A generous timeout: the machine running CI may be oversubscribed.
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield exporter, engine, http, app
    assert app.state.jx.internal_errors == 0


def _tree(exporter: InMemorySpanExporter) -> tuple:
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name.startswith("POST ")]
    assert len(roots) == 1, [(s.name, s.start_time, s.end_time, s.attributes) for s in spans]
    root = roots[0]
    children = {s.name: s for s in spans if s.parent is not None
                and s.parent.span_id == root.context.span_id}
    return root, children


def test_request_span_with_phases_and_traceparent(traced):
    exporter, engine, http, _ = traced
    exporter.clear()
    r = http.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    root, children = _tree(exporter)
    assert root.name == "POST /v1/chat/completions"
    # the caller's trace continues: same trace id, its span is our parent
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    a = root.attributes
    assert a["gen_ai.request.model"] == "mock-model"
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"] == 5
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    assert set(children) == {"queue", "prefill", "decode"}
    q, p, d = children["queue"], children["prefill"], children["decode"]
    # phases are contiguous, in order, and inside the request span
    times = [(s.name, s.start_time, s.end_time) for s in (root, q, p, d)]
    assert root.start_time <= q.start_time <= q.end_time == p.start_time <= p.end_time == d.start_time, times
    assert d.start_time <= d.end_time <= root.end_time, times
    assert root.status.status_code != StatusCode.ERROR


def test_without_traceparent_a_new_trace_starts(traced):
    exporter, _, http, _ = traced
    exporter.clear()
    r = http.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    root, children = _tree(exporter)
    assert root.name == "POST /generate" and root.parent is None
    assert format(root.context.trace_id, "032x") != TRACE_ID
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and set(children) == {"queue", "prefill", "decode"}


def test_aborted_stream_is_traced_as_abort(traced):
    exporter, engine, http, _ = traced
    exporter.clear()
    body = {**CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 30       # the server notices the disconnect, then writes the trace
    while not exporter.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.02)
    root, _ = _tree(exporter)
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["gen_ai.usage.output_tokens"] < 200


def test_bad_endpoint_is_refused():
    with pytest.raises(ValueError, match="otlp-traces-endpoint"):
        RequestTracing("localhost:4318")


def test_off_by_default_imports_nothing():
    """Without --otlp-traces-endpoint the server never imports OpenTelemetry."""
    code = ("import sys, argparse; sys.path.insert(0, 'tests'); from mock_engine import MockAsyncEngine;"
            "from serving.server import add_serve_args; from serving.app import build_app;"
            "p = argparse.ArgumentParser(); add_serve_args(p); a = p.parse_args([]);"
            "assert a.otlp_traces_endpoint is None; build_app(MockAsyncEngine());"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'serving.tracing'))))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's trace endpoint: decodes ExportTraceServiceRequest bodies."""

    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        self.received.append((self.path, self.headers.get("Content-Type"), req))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args):
        pass


def test_exports_to_an_otlp_http_receiver():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.received = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{srv.server_address[1]}/v1/traces"
    try:
        app = build_app(MockAsyncEngine(), tracing=RequestTracing(endpoint, service_name="jx-test"))
        with serve_in_thread(app) as url:
            # greedy: a sampled mock continuation starts at a random corpus offset and can
            # hit EOS within 4 tokens (this failed CI once with 2 output tokens)
            r = httpx.post(url + "/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=60,
                           json={"model": "mock-model", "prompt": "abc", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200
        # leaving the server's lifespan shut the tracing down, which flushed the batch
    finally:
        srv.shutdown()
    assert _Receiver.received, "no OTLP export arrived"
    path, ctype, req = _Receiver.received[0]
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    rs = req.resource_spans[0]
    service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
    assert service == "jx-test"
    spans = [s for ss in rs.scope_spans for s in ss.spans]
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/completions", "queue", "prefill", "decode"}
    root = by_name["POST /v1/completions"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    assert all(by_name[n].parent_span_id == root.span_id for n in ("queue", "prefill", "decode"))
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert attrs["gen_ai.request.model"].string_value == "mock-model"

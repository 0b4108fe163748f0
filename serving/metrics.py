"""Prometheus metrics, named as vLLM names them but under a ``jaxinfer:`` prefix.

Two sources:

- Engine state (running / waiting requests, KV cache usage, token and preemption
  counters) is read from ``engine.stats()`` at scrape time by a custom collector, so the
  numbers are never stale and the engine loop pays nothing for them.
- Per-request latencies (time to first token, inter-token latency, time per output token,
  end-to-end latency, queue time) and finish reasons are observed by the server as each
  request ends, from the ``RequestMetrics`` times the engine fills in (``time.monotonic``).

Each app gets its own ``CollectorRegistry``, so several servers can live in one process
(tests) without clashing over global metric names.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.outputs import RequestOutput

log = logging.getLogger("jaxinfer.serving")

PREFIX = "jaxinfer:"
# Buckets reach below vLLM's because a small model on an accelerator answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
CONTENT_TYPE = CONTENT_TYPE_LATEST

# engine.stats() key -> (metric name, help, kind)
_ENGINE_METRICS = (
    ("num_running", "num_requests_running", "Requests currently running on the engine.", "gauge"),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).", "gauge"),
    ("num_free_pages", "kv_cache_free_pages", "KV cache pages free.", "gauge"),
    ("num_total_pages", "kv_cache_total_pages", "KV cache pages in total.", "gauge"),
    ("num_preemptions_total", "num_preemptions", "Cumulative number of preemptions.", "counter"),
    ("num_failed_steps_total", "num_failed_steps", "Steps that raised; each failed only its own requests "
     "(the engine served on).", "counter"),
    ("prompt_tokens_total", "prompt_tokens", "Prefill tokens processed.", "counter"),
    ("generation_tokens_total", "generation_tokens", "Generation tokens produced.", "counter"),
    ("prefix_cache_queries_total", "prefix_cache_queries",
     "Prefix cache queries, in tokens (prompt tokens looked up at admission).", "counter"),
    ("prefix_cache_hits_total", "prefix_cache_hits", "Prefix cache hits, in tokens (not recomputed).", "counter"),
    ("prefix_cache_host_hits_total", "external_prefix_cache_hits",
     "Prefix cache hits served by the host-memory tier, in tokens (part of prefix_cache_hits).", "counter"),
    ("prefix_cache_pages", "prefix_cache_pages", "KV pages held by the prefix cache on the device.", "gauge"),
    ("host_cache_pages", "host_prefix_cache_pages", "KV pages held by the host-memory tier.", "gauge"),
    ("host_cache_total_pages", "host_prefix_cache_total_pages", "Host-memory tier capacity, in pages.", "gauge"),
    ("host_ms_per_step", "step_host_ms", "Host work per engine step, ms (its life's mean).", "gauge"),
    ("critical_host_ms_per_step", "step_critical_host_ms",
     "Host work per step the device had nothing queued for, ms (an upper bound; the overlapped loop "
     "hides the rest).", "gauge"),
    ("device_ms_per_step", "step_device_ms", "The device's share of a step's wall time, ms.", "gauge"),
    ("overlapped_fraction", "step_overlapped_fraction", "Fraction of the host's step work the device "
     "overlapped (0..1).", "gauge"),
    ("prefill_tokens_per_s", "prefill_tokens_per_second", "Prompt tokens computed per second while "
     "requests queue (admission control's EWMA over steps).", "gauge"),
    ("queued_prompt_tokens", "queued_prompt_tokens", "Prompt tokens of requests waiting for their first "
     "token.", "gauge"),
    ("predicted_queue_delay_s", "predicted_queue_delay_seconds", "Predicted wait for a first token of a "
     "request arriving now behind every queued one (queued prompt tokens over the prefill rate).", "gauge"),
    ("buckets_compiled", "compiled_buckets", "Step shapes compiled so far (the rest compile in the "
     "background after start-up).", "gauge"),
    ("buckets_total", "buckets", "Step shapes the engine compiles in all.", "gauge"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative drafts verified.", "counter"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed.", "counter"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "counter"),
    ("spec_decode_num_tree_branches", "spec_decode_num_tree_branches",
     "Extra prompt-lookup candidates verified (--speculative-tree-width).", "counter"),
    ("spec_decode_num_tree_branch_wins", "spec_decode_num_tree_branch_wins",
     "Steps whose longest accepted candidate was an extra one.", "counter"),
)


class _EngineCollector:
    """Reads ``engine.stats()`` at scrape time (gauges and the engine's own counters)."""

    def __init__(self, get_engine: Callable[[], Any], model_name: Callable[[], str]) -> None:
        self.get_engine = get_engine
        self.model_name = model_name

    def describe(self) -> list:
        return []   # names are fixed and unique; skip the registry's collect-at-register probe

    def collect(self):
        engine = self.get_engine()
        if engine is None:
            return
        try:
            stats = engine.stats()
        except Exception:   # a dying engine must not break /metrics
            log.exception("engine.stats() failed during a metrics scrape")
            return
        label = [self.model_name()]
        for key, name, doc, kind in _ENGINE_METRICS:
            if key not in stats:
                continue
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(label, float(stats[key]))
            yield fam
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            fam = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
            for i, n in enumerate(per_pos):
                fam.add_metric(label + [str(i)], float(n))
            yield fam
        kernels = stats.get("kernels") or {}
        if kernels:
            fam = GaugeMetricFamily(PREFIX + "kernel_info", "The implementation serving each kind of op "
                                    "(1 per op).", labels=["model_name", "op", "implementation"])
            for op, impl in sorted(kernels.items()):
                fam.add_metric(label + [str(op), str(impl)], 1.0)
            yield fam


class ServingMetrics:
    """The server's metrics registry; ``render()`` gives the Prometheus text exposition."""

    def __init__(self, get_engine: Callable[[], Any], model_name: Callable[[], str]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.registry.register(_EngineCollector(get_engine, model_name))
        lbl = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, lbl, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive output tokens.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before first scheduled.",
                          LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                               lbl + ["finish_reason"], registry=self.registry)
        self.rejected = Counter(PREFIX + "request_rejected", "Requests refused before generation, by reason.",
                                lbl + ["reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, on_finish: Callable[[RequestOutput | None, bool], None] | None = None
                ) -> "RequestTracker":
        return RequestTracker(self, on_finish)


class RequestTracker:
    """Follows one request's outputs as they arrive and records its metrics once at the end."""

    __slots__ = ("m", "start", "last_time", "first_time", "ntok", "done", "on_finish")

    def __init__(self, metrics: ServingMetrics,
                 on_finish: Callable[[RequestOutput | None, bool], None] | None = None) -> None:
        self.m = metrics
        self.on_finish = on_finish       # (last output, aborted): e.g. write the trace
        self.start = time.monotonic()
        self.last_time: float | None = None
        self.first_time: float | None = None
        self.ntok: dict[int, int] = {}
        self.done = False

    def update(self, out: RequestOutput) -> None:
        """Note newly arrived tokens: each gets an equal share of the time since the last ones."""
        now = time.monotonic()
        counts = []
        for o in out.outputs:
            k = len(o.token_ids) - self.ntok.get(o.index, 0)
            if k > 0:
                self.ntok[o.index] = len(o.token_ids)
                counts.append(k)
        if not counts:
            return
        if self.last_time is None:
            self.first_time = now
        else:
            h = self.m.itl.labels(self.m.model_name())
            for k in counts:
                gap = (now - self.last_time) / k
                for _ in range(k):
                    h.observe(gap)
        self.last_time = now

    def finish(self, out: RequestOutput | None, aborted: bool = False) -> None:
        if self.done:
            return
        self.done = True
        name = self.m.model_name()
        now = time.monotonic()
        met = out.metrics if out is not None else None
        arrival = met.arrival_time if met is not None else self.start
        first_tok = (met.first_token_time if met is not None and met.first_token_time is not None
                     else self.first_time)
        finished = met.finished_time if met is not None and met.finished_time is not None else now
        if met is not None and met.first_scheduled_time is not None:
            self.m.queue.labels(name).observe(max(0.0, met.first_scheduled_time - arrival))
        if first_tok is not None:
            self.m.ttft.labels(name).observe(max(0.0, first_tok - arrival))
        self.m.e2e.labels(name).observe(max(0.0, finished - arrival))
        if out is not None:
            self.m.prompt_len.labels(name).observe(len(out.prompt_token_ids))
            longest = max((len(o.token_ids) for o in out.outputs), default=0)
            self.m.gen_len.labels(name).observe(sum(len(o.token_ids) for o in out.outputs))
            if longest > 1 and first_tok is not None:
                self.m.tpot.labels(name).observe(max(0.0, finished - first_tok) / (longest - 1))
        reason = "abort" if aborted or out is None or not out.outputs else (out.outputs[0].finish_reason or "abort")
        self.m.success.labels(name, reason).inc()
        if self.on_finish is not None:
            try:
                self.on_finish(out, aborted)
            except Exception:   # observability must never fail a request
                log.exception("request finish hook failed")

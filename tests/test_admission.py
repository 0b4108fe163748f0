"""Admission control (jaxinfer/engine/admission.py, EngineConfig.max_queue_delay_ms): the
prediction on its own (host only), then a 500-request burst against the REAL engine (the
tiny model of tests/tiny_server.py) over HTTP: the excess is refused with 503 +
Retry-After in OpenAI's error shape, every accepted request finishes with all its tokens,
nothing is lost, and /metrics counts the refusals. How fast the refusals come is measured
by benchmarks/admission_burst.py, not asserted here."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from test_priority import assert_no_leak  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from jaxinfer.engine.admission import Admission  # noqa: E402
from jaxinfer.errors import QueueFullError  # noqa: E402
from serving.app import build_app  # noqa: E402


def test_before_a_measurement_the_bound_is_a_queue_length():
    adm = Admission(100, max_num_seqs=3)
    for i in range(3):
        adm.enter(f"r{i}", 0, 1000)             # 0, 1, 2 ahead: all in
    with pytest.raises(QueueFullError) as e:
        adm.enter("r3", 0, 1)
    assert e.value.reason == "queue_delay" and e.value.retry_after_s >= 1
    adm.leave("r0")
    adm.enter("r3", 0, 1)


def test_predicted_delay_from_the_measured_rate():
    adm = Admission(100, max_num_seqs=1)
    adm.observe(0, 0.5)                          # the overlapped loop's first call: no measurement
    assert adm.stats()["prefill_tokens_per_s"] == 0.0
    adm.observe(1000, 1.0)                       # 1000 tokens/s: 100 ms = 100 tokens
    adm.enter("a", 0, 500)                       # nothing ahead: always admitted
    with pytest.raises(QueueFullError) as e:
        adm.enter("b", 0, 1)                     # 501 tokens ahead + its own: 502 ms
    assert e.value.retry_after_s == 1
    assert adm.stats()["predicted_queue_delay_s"] == pytest.approx(0.5)
    adm.leave("a")
    adm.enter("b", 0, 60)
    adm.enter("c", 0, 40)                        # 60 + 40 = 100 tokens: exactly 100 ms
    with pytest.raises(QueueFullError):
        adm.enter("d", 0, 1)
    assert adm.num_rejected == 2
    for rid in "abc":
        adm.leave(rid)
    assert adm.stats()["queued_prompt_tokens"] == 0


def test_a_slower_rate_refuses_sooner():
    adm = Admission(100, max_num_seqs=1)
    adm.observe(1000, 1.0)
    adm.enter("a", 0, 50)
    adm.enter("b", 0, 40)                        # 90 ms
    for _ in range(50):                          # steps that computed no prompt token
        adm.observe(0, 1.0)
    with pytest.raises(QueueFullError):
        adm.enter("c", 0, 1)


def test_priority_counts_only_what_runs_before_it():
    adm = Admission(100, max_num_seqs=1, policy="priority")
    adm.observe(1000, 1.0)
    adm.enter("low", 5, 5000)
    adm.enter("urgent", 0, 50)                   # the 5000 low tokens run after it
    with pytest.raises(QueueFullError):
        adm.enter("low2", 5, 1)
    fcfs = Admission(100, max_num_seqs=1)        # fcfs: everything queued is ahead
    fcfs.observe(1000, 1.0)
    fcfs.enter("low", 5, 5000)
    with pytest.raises(QueueFullError):
        fcfs.enter("urgent", 0, 50)


def test_off_admits_everything():
    adm = Admission(None, max_num_seqs=1)
    adm.observe(1, 10.0)
    for i in range(100):
        adm.enter(f"r{i}", 0, 10_000)


# ------------------------------------------------------------------ the burst, real engine

BURST = 500
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine(max_queue_delay_ms=50)
    app = build_app(aeng)
    with serve_in_thread(app) as url:
        yield url, app, aeng
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


async def _burst(url: str) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        async def one(i: int) -> httpx.Response:
            return await http.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": f"request number {i} says", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0})
        return await asyncio.gather(*(one(i) for i in range(BURST)))


def test_burst_excess_refused_with_retry_after_and_nothing_lost(server):
    url, app, aeng = server
    responses = asyncio.run(_burst(url))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == BURST, sorted({r.status_code for r in responses})
    assert ok and refused, (len(ok), len(refused))
    for r in ok:
        body = r.json()
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["finish_reason"] == "length"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "overloaded", err
        assert "predicted wait" in err["message"] or "queued ahead" in err["message"], err
    text = httpx.get(url + "/metrics").text
    line = f'jaxinfer:request_rejected_total{{model_name="{MODEL_NAME}",reason="queue_delay"}}'
    assert f"{line} {float(len(refused))}" in text
    assert f'jaxinfer:queued_prompt_tokens{{model_name="{MODEL_NAME}"}} 0.0' in text
    assert "jaxinfer:prefill_tokens_per_second" in text and "jaxinfer:predicted_queue_delay_seconds" in text
    assert aeng.admission.stats()["num_rejected_queue_delay_total"] == len(refused)
    assert_no_leak(aeng.engine)

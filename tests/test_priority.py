"""Request priorities on the REAL engine (the tiny model of tests/tiny_server.py): the
"priority" policy serves a more urgent request first and preempts less urgent running
ones for it; "fcfs" refuses a non-zero priority (vLLM's behaviour), over HTTP a 400 naming
the field. The scheduler's own priority tests (and its randomized simulation with
priorities, synchronous and overlapped) are in tests/test_scheduler.py."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine.sequence import SequenceStatus  # noqa: E402
from serving.app import build_app  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompt(i: int) -> list[int]:
    return [100 + (7 * i + j) % 500 for j in range(6 + i % 5)]


@pytest.fixture(scope="module")
def aeng():
    aeng = tiny_async_engine(scheduling_policy="priority")
    yield aeng
    asyncio.run(aeng.shutdown())


def assert_no_leak(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished()
    assert bm.num_free_pages == bm.num_usable_pages


def test_urgent_request_behind_64_queued_gets_its_first_token_before_them(aeng):
    """64 requests of priority 1 queue up (4 seats); one of priority 0 arrives behind
    them: it gets its first token no later than any of those still waiting when it
    arrived (the engine's own times: RequestMetrics)."""
    async def run(rid: str, ids: list[int], priority: int):
        last = None
        async for out in aeng.generate(ids, greedy(8), rid, priority=priority):
            last = out
        return last

    async def main():
        lows = [asyncio.ensure_future(run(f"low{i}", prompt(i), 1)) for i in range(64)]
        while len(aeng.engine.output.requests) < 32:       # the engine has them queued
            await asyncio.sleep(0.001)
        return await asyncio.gather(run("urgent", prompt(99), 0), *lows)

    urgent, *lows = asyncio.run(main())
    u = urgent.metrics
    behind = [o for o in lows if o.metrics.first_scheduled_time > u.arrival_time]
    assert len(behind) >= 24, len(behind)                 # the test means something
    late = [o.request_id for o in behind if o.metrics.first_token_time < u.first_token_time]
    assert not late, f"waiting low-priority requests got a first token before the urgent one: {late}"
    assert all(len(o.outputs[0].token_ids) == 8 for o in lows + [urgent])
    assert_no_leak(aeng.engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_preempted_low_priority_requests_finish_with_their_own_tokens(aeng, overlap):
    """Every seat held by low-priority decodes; an urgent request arrives: a low one is
    preempted at once, the urgent one runs to its end first, and every request's greedy
    tokens are those it gets alone; no KV page is leaked. ``overlap``: the overlapped
    step loop (preempting a sequence whose token is still in flight) or the synchronous one."""
    sync = None if overlap else tiny_async_engine(scheduling_policy="priority", async_scheduling=False)
    a = aeng if overlap else sync
    engine = a.engine
    assert engine.overlap is overlap
    try:
        with a._wake:                          # drive the engine directly while its loop idles
            assert not a._inbox and not engine.has_unfinished()
            low_ids, urgent_id, outs, preempted = _run_preemption(engine)
            alone = {rid: engine.generate([prompt(i)], greedy(6 if rid == urgent_id else 24))[0].outputs[0].token_ids
                     for i, rid in list(enumerate(low_ids)) + [(99, urgent_id)]}
    finally:
        if sync is not None:
            asyncio.run(sync.shutdown())
    assert preempted, "no low-priority request was preempted"
    order = [rid for rid, _ in outs]
    assert order.index(urgent_id) < min(order.index(r) for r in preempted)
    assert dict(outs) == alone
    assert_no_leak(engine)


def _run_preemption(engine):
    seats = engine.config.max_num_seqs
    low_ids = [engine.add_request(prompt(i), greedy(24), f"p-low{i}", priority=5) for i in range(seats)]
    outs: list[tuple[str, list[int]]] = []

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outs.append((out.request_id, out.outputs[0].token_ids))

    while not all(engine.output.requests[r].seqs[0].num_output_tokens >= 3 for r in low_ids):
        step()
    urgent = engine.add_request(prompt(99), greedy(6), "p-urgent", priority=-5)
    step()
    seq = engine.output.requests[urgent].seqs[0]
    assert seq.status is SequenceStatus.RUNNING              # admitted at once: a seat was freed
    preempted = [r for r in low_ids if engine.output.requests[r].seqs[0].num_preemptions]
    while engine.has_unfinished():
        step()
    return low_ids, urgent, outs, preempted


def test_fcfs_refuses_a_priority_priority_policy_takes_it():
    fcfs = tiny_async_engine()
    try:
        with pytest.raises(ValueError, match="priority"):
            fcfs.engine.add_request(prompt(0), greedy(2), priority=1)
        with fcfs._wake:
            rid = fcfs.engine.add_request(prompt(0), greedy(2), priority=0)   # 0 is every request's
            fcfs.engine.run_until_done([rid])
        app = build_app(fcfs)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "priority": 3}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
            r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, "priority": -1,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
            assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
        assert app.state.jx.internal_errors == 0
    finally:
        asyncio.run(fcfs.shutdown())


def test_priority_field_over_http(aeng):
    app = build_app(aeng, shutdown_engine=False)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
        for p in (-3, 0, 7):
            assert http.post("/v1/completions", json={**body, "priority": p}).status_code == 200
        for bad in (2**63, -(2**63) - 1, "high", 1.5, True):
            r = http.post("/v1/completions", json={**body, "priority": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)
    assert app.state.jx.internal_errors == 0
    assert_no_leak(aeng.engine)

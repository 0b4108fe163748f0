"""Start-up compilation (engine/warmup.py): the buckets a first request needs first, the
rest in a background thread while requests are served; once the engine reports warm, no
step compiles. Steps taken while warming may run in a larger compiled bucket: the tokens
must be those of an engine that compiled everything first. /health reports warming/ready.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.engine_config import EngineConfig
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.batch import Bucket, BucketLadders, default_ladders
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.warmup import priority_order

from tp_worker import tiny_loaded

# Six buckets (decode 1 / 3; prefill of 16 or 64 positions, alone or beside 3 decodes) and
# two sampler widths (1 and 4 rows; the sampler is the slowest part to compile): two
# buckets compile before the engine returns, four in the background. A page-table width
# no other test uses, so the run's shared compilation cache cannot make warm-up instant.
KW = dict(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=208, num_pages=64,
          page_buckets=(13,), decode_buckets=(1, 3), mixed_decode_buckets=(0, 3),
          prefill_buckets=((1, 16), (1, 64)))


class CompileCounter:
    """XLA backend compiles (jax.monitoring), in any thread, while active."""

    def __init__(self) -> None:
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, secs: float, **kw) -> None:
        if self.active and name == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


def _ladders() -> BucketLadders:
    return BucketLadders((1, 4), (0, 4), ((1, 16), (4, 16)), (13,))


def test_priority_order_first_request_buckets_first():
    first, rest = priority_order(_ladders())
    # no prefill shape holds 128 positions: the largest one
    assert first == [Bucket.of(1, 0, 0, 13), Bucket.of(0, 4, 16, 13)]
    assert sorted(first + rest) == _ladders().all_buckets() and not set(first) & set(rest)
    assert rest == sorted(rest)
    # the default ladder: 4 slots of 32 (128 positions) is the smallest that holds 128
    default = default_ladders(64, 2048, 16, 512)
    m = default.min_sample_rows
    assert priority_order(default)[0] == [Bucket.of(1, 0, 0, 128, False, m), Bucket.of(0, 4, 32, 128, False, m)]


def test_choose_falls_back_to_a_compiled_bucket_that_holds_the_step():
    lad = _ladders()
    compiled = {Bucket.of(1, 0, 0, 13), Bucket.of(0, 1, 16, 13), Bucket.of(4, 4, 16, 13)}
    ready = compiled.__contains__
    # two decodes: decode-4 is not compiled; the mixed 4 + 4x16 bucket holds them
    assert lad.choose(2, [], 3, ready) == Bucket.of(4, 4, 16, 13)
    # a 40-token chunk needs 3 slots of 16: (0; 4x16) is missing, (4; 4x16) holds it
    assert lad.choose(0, [40], 3, ready) == Bucket.of(4, 4, 16, 13)
    # nothing compiled holds it: the ideal bucket (the caller compiles it, then runs)
    assert lad.choose(2, [], 3, lambda b: False) == Bucket.of(4, 0, 0, 13)
    # no predicate, or the ideal bucket compiled: unchanged
    assert lad.choose(1, [], 3, ready) == lad.choose(1, [], 3) == Bucket.of(1, 0, 0, 13)


def _prompts(rng: np.random.RandomState) -> list[list[int]]:
    return [rng.randint(1, 512, size=int(n)).tolist() for n in rng.choice([3, 9, 17, 40, 60], size=10)]


def _run(eng: Engine, prompts, params, warm_seen: list[bool] | None = None) -> dict[str, list[int]]:
    """Requests arrive two per step; -> {request id: greedy tokens}."""
    outs, pending = {}, list(enumerate(prompts))
    while pending or eng.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                eng.add_request(p, params, request_id=f"r{i}")
        if warm_seen is not None:
            warm_seen.append(eng.is_warm)
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_background_warmup_serves_while_compiling_and_never_compiles_once_warm():
    loaded = tiny_loaded("llama_8q4kv")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rng = np.random.RandomState(0)
    eng = Engine(loaded=loaded, progress=False, config=EngineConfig(warmup="background", **KW))
    try:
        status = eng.warmup_status()
        assert status == {"warm": False, "buckets_compiled": 2, "buckets_total": 6}, status
        warm_seen: list[bool] = []
        during = _run(eng, _prompts(rng), params, warm_seen)
        assert not warm_seen[0], "the test meant requests to arrive during warm-up"
        assert eng.wait_until_warm(timeout=300)
        assert eng.warmup_status() == {"warm": True, "buckets_compiled": 6, "buckets_total": 6}
        COMPILES.count, COMPILES.active = 0, True
        try:
            after = _run(eng, _prompts(rng), params)
        finally:
            COMPILES.active = False
        assert COMPILES.count == 0, f"{COMPILES.count} compiles after the engine reported warm"
        assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"], "leaked KV pages"
    finally:
        eng.shutdown()

    # The same requests on an engine that compiled every bucket first: the same tokens,
    # whichever (larger) buckets the warming engine ran them in.
    full = Engine(loaded=loaded, progress=False, config=EngineConfig(warmup="full", **KW))
    assert full.is_warm
    rng = np.random.RandomState(0)
    assert _run(full, _prompts(rng), params) == during
    assert _run(full, _prompts(rng), params) == after


def test_lazy_warmup_compiles_a_bucket_when_a_step_first_needs_it():
    loaded = tiny_loaded("llama_8q4kv")
    eng = Engine(loaded=loaded, progress=False, config=EngineConfig(warmup="lazy", **KW))
    assert eng.warmup_status()["buckets_compiled"] == 2
    # two 40-token prompts: one prefills alone (a start-up bucket), the other beside its
    # decode (a mixed bucket, compiled then), then both decode (decode-3, compiled then)
    out = eng.generate([list(range(1, 41)), list(range(2, 42))], SamplingParams(temperature=0, max_tokens=3))
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert 2 < eng.warmup_status()["buckets_compiled"] < 6 and not eng.is_warm


@pytest.mark.parametrize("status,body", [
    ({"warm": False, "buckets_compiled": 2, "buckets_total": 6},
     {"status": "warming", "buckets_compiled": 2, "buckets_total": 6}),
    ({"warm": True, "buckets_compiled": 6, "buckets_total": 6}, {"status": "ready"}),
])
def test_health_reports_warming_then_ready(status, body):
    from starlette.testclient import TestClient

    from mock_engine import MockAsyncEngine
    from serving.app import build_app

    engine = MockAsyncEngine()
    engine.warmup_status = lambda: status
    r = TestClient(build_app(engine)).get("/health")
    assert r.status_code == 200 and r.json() == body


"""One request must never take the engine down or hold everyone else up (issue #51), against
the REAL engine behind the server (the tiny model of tests/tiny_server.py), not the mock:

- the probe's requests that killed the engine or gave 500s now get a 4xx in the route's own
  error shape, and the engine serves the next request;
- every numeric field of every generation route (read from the server's OpenAPI schema, so a
  new field is swept too) with 0, -1, 2**31, 2**63, 1e308, -1e308, NaN and a 5000-digit
  integer: never a 500, never a dead engine, every page back afterwards;
- an exception inside a step fails that step's requests (a 500 in the API's shape, or an
  error event in a stream) and no other: requests waiting meanwhile finish with the tokens
  they get alone, and the next request succeeds;
- a step that loses the device state kills the engine, and ``jaxinfer serve``'s server
  then exits non-zero (a supervisor restarts it) instead of answering 503 forever.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from test_serving import sse_events, wait_for  # noqa: E402
from test_serving_engine import server_process  # noqa: E402
from tiny_server import MODEL_NAME, tiny_async_engine  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from serving.app import build_app  # noqa: E402
from serving.openapi import openapi_schema  # noqa: E402

CMPL, CHAT, TGI = "/v1/completions", "/v1/chat/completions", "/generate"
BASE = {CMPL: {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3},
        CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
        TGI: {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}}
BASE["/generate_stream"] = BASE[TGI]
BASE["/v1/responses"] = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 3}
# The LoRA routes take no number; their fields get the extremes all the same (the parser must
# refuse a number where a name or path belongs: 400, not a crash).
LORA = {"/v1/load_lora_adapter": ("lora_name", "lora_path"), "/v1/unload_lora_adapter": ("lora_name",)}
for _path, _keys in LORA.items():
    BASE[_path] = {k: "x" for k in _keys}


@pytest.fixture(scope="module")
def server():
    aeng = tiny_async_engine()
    app = build_app(aeng)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield SimpleNamespace(url=url, app=app, aeng=aeng, http=http)
    asyncio.run(aeng.shutdown())


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, json=body)


def assert_error_shape(r: httpx.Response, path: str) -> str:
    """The route's own error body (OpenAI's object, TGI's flat one) -> its message."""
    body = r.json()
    if path in (TGI, "/generate_stream"):
        assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
        return body["error"]
    assert isinstance(body.get("error"), dict) and isinstance(body["error"]["message"], str), body
    return body["error"]["message"]


def assert_serving_and_idle(server) -> None:
    """The engine lives, a plain request succeeds, and nothing is left running or held."""
    assert not server.aeng.is_dead and server.http.get("/health").json()["status"] in ("ready", "warming")
    r = post(server, CMPL, {**BASE[CMPL], "temperature": 0})
    assert r.status_code == 200, r.text
    metrics = {}
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith("jaxinfer:") and "model_name" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            metrics[name] = value
    assert wait_for(lambda: server.aeng.stats()["num_running"] == 0)
    assert metrics["jaxinfer:num_requests_running"] == 0
    assert metrics["jaxinfer:kv_cache_free_pages"] == metrics["jaxinfer:kv_cache_total_pages"]


# ------------------------------------------------------------- the probe's findings, one each

DEEP = "[" * 5000 + "]" * 5000
BEAM = {"use_beam_search": True, "best_of": 2, "temperature": 0}
FINDINGS = [
    ("top_k-2^31-completions", CMPL, {"top_k": 2**31}, "top_k"),
    ("top_k-2^31-chat", CHAT, {"top_k": 2**31}, "top_k"),
    ("top_k-2^31-tgi", TGI, {"parameters": {"max_new_tokens": 3, "top_k": 2**31}}, "top_k"),
    ("top_k-over-vocab", CMPL, {"top_k": 10**6}, "vocabulary"),
    ("length_penalty-1e308", CMPL, {**BEAM, "length_penalty": 1e308}, "length_penalty"),
    ("length_penalty--1e308", CMPL, {**BEAM, "length_penalty": -1e308}, "length_penalty"),
    ("length_penalty-700", CMPL, {**BEAM, "length_penalty": 700}, "length_penalty"),
    ("tgi-length_penalty-700", TGI, {"parameters": {"max_new_tokens": 3, "num_beams": 2, "length_penalty": 700}},
     "length_penalty"),
    ("guided_json-string-5000-deep", CMPL, {"guided_json": DEEP}, "nested"),
    ("tgi-grammar-string-5000-deep", TGI,
     {"parameters": {"max_new_tokens": 3, "grammar": {"type": "json", "value": DEEP}}}, "nested"),
    ("guided_json-5000-digit-int", CMPL,
     {"guided_json": '{"type": "integer", "maximum": ' + "9" * 5000 + "}"}, "digits"),
]


@pytest.mark.parametrize("path,extra,needle", [f[1:] for f in FINDINGS], ids=[f[0] for f in FINDINGS])
def test_probe_findings_get_4xx_and_the_engine_serves_on(server, path, extra, needle):
    r = post(server, path, {**BASE[path], **extra})
    assert r.status_code in (400, 422), (r.status_code, r.text[:300])
    msg = assert_error_shape(r, path)
    assert needle in msg and "sys." not in msg and "Traceback" not in msg, msg
    assert_serving_and_idle(server)


# ------------------------------------------------------------- the field-extremes sweep

EXTREMES = {"0": "0", "-1": "-1", "2^31": str(2**31), "2^63": str(2**63), "1e308": "1e308",
            "-1e308": "-1e308", "NaN": "NaN", "5000-digits": "9" * 5000}
SLOT = "__EXTREME__"


def numeric_fields(schema: dict) -> list[tuple[str, ...]]:
    """Paths of every integer / number property (also array items and object values) of a
    request schema, e.g. ("parameters", "top_k"), ("stop_token_ids", 0), ("logit_bias", "1")."""
    def walk(s: dict, path: tuple) -> list[tuple]:
        kinds = [s] + s.get("oneOf", [])
        out = [path] if any(k.get("type") in ("integer", "number") for k in kinds) else []
        for k in kinds:
            for name, sub in k.get("properties", {}).items():
                out += walk(sub, path + (name,))
            if isinstance(k.get("items"), dict):
                out += walk(k["items"], path + (0,))
            if isinstance(k.get("additionalProperties"), dict):
                out += walk(k["additionalProperties"], path + ("1",))
        return out
    return sorted(set(walk(schema, ())), key=str)


def request_with(path: str, field: tuple, literal: str) -> bytes:
    """BASE[path] with ``literal`` written raw (NaN and 5000 digits are not Python-dumpable)
    at ``field``; beam-only fields get a beam search to act on."""
    body = json.loads(json.dumps(BASE[path]))
    if field[-1] == "length_penalty":
        if path == CMPL:
            body.update(BEAM)
        else:
            body["parameters"]["num_beams"] = 2
    node = body
    for key, nxt in zip(field[:-1], field[1:]):        # dicts down to the last level
        want = list if isinstance(nxt, int) else dict
        if not isinstance(node.get(key), want):
            node[key] = want()
        node = node[key]
    if isinstance(field[-1], int):
        node[:] = [SLOT]
    else:
        node[field[-1]] = SLOT
    return json.dumps(body).replace(f'"{SLOT}"', literal).encode()


def sweep_cases() -> list[tuple[str, tuple, str]]:
    paths = openapi_schema()["paths"]
    cases = []
    for path in (CMPL, CHAT, TGI, "/generate_stream", "/v1/responses"):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for field in numeric_fields(schema):
            cases += [(path, field, name) for name in EXTREMES]
    cases += [(path, (key,), name) for path, keys in LORA.items() for key in keys for name in EXTREMES]
    return cases


def test_the_sweep_covers_every_numeric_field():
    """The sweep reads the schema; this pins that the schema names the fields it must."""
    fields = {(p, f) for p, f, _ in sweep_cases()}
    for name in ("n", "top_k", "top_p", "temperature", "min_p", "seed", "max_tokens", "min_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "best_of",
                 "length_penalty", "prompt_logprobs"):
        assert (CMPL, (name,)) in fields, name
    assert (CMPL, ("stop_token_ids", 0)) in fields and (CMPL, ("logit_bias", "1")) in fields
    assert (CMPL, ("prompt", 0)) in fields and (CMPL, ("watermark", "gamma")) in fields
    assert (CHAT, ("top_logprobs",)) in fields and (CHAT, ("max_completion_tokens",)) in fields
    for name in ("max_new_tokens", "top_k", "top_p", "temperature", "seed", "top_n_tokens",
                 "repetition_penalty", "num_beams", "length_penalty"):
        assert (TGI, ("parameters", name)) in fields, name
    for name in ("temperature", "top_p", "max_output_tokens"):
        assert ("/v1/responses", (name,)) in fields, name


def test_field_extremes_never_500_never_kill_the_engine(server):
    failures = []
    for path, field, name in sweep_cases():
        r = post(server, path, request_with(path, field, EXTREMES[name]))
        if r.status_code >= 500 or server.aeng.is_dead:
            failures.append((path, field, name, r.status_code, r.text[:200]))
            if server.aeng.is_dead:
                break
        elif r.status_code != 200:
            assert r.status_code in (400, 422), (path, field, name, r.status_code, r.text[:200])
            assert_error_shape(r, path)
    assert not failures, failures
    assert server.app.state.jx.internal_errors == 0
    assert_serving_and_idle(server)


# ------------------------------------------------------------- a step that raises

class FailNext:
    """Engine.fault_hook: once armed, the ``skip + 1``-th scheduled step raises; records
    whose requests it held."""

    def __init__(self) -> None:
        self.armed, self.skip, self.request_ids = False, 0, set()

    def arm(self, skip: int = 0) -> None:
        self.skip, self.armed = skip, True

    def __call__(self, sched) -> None:
        if not self.armed:
            return
        if self.skip:
            self.skip -= 1
            return
        self.armed = False
        self.request_ids = {e.seq.request_id for e in sched.scheduled}
        raise RuntimeError("injected step fault")


def test_a_failed_step_fails_only_its_requests(server):
    engine = server.aeng.engine
    hook = engine.fault_hook = FailNext()
    try:
        expect = {}          # what each prompt gives alone, greedy
        prompts = [f"Prompt number {i} says" for i in range(8)]
        for p in prompts:
            expect[p] = post(server, CMPL, {**BASE[CMPL], "prompt": p, "max_tokens": 6, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
        failed_before = engine.num_failed_steps

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                hook.arm()     # 8 requests, 4 rows: the first step holds some, others wait
                return await asyncio.gather(*[c.post(CMPL, json={
                    **BASE[CMPL], "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
                    for p in prompts])

        rs = asyncio.run(main())
        failed = [r for r in rs if r.status_code == 500]
        assert 1 <= len(failed) == len(hook.request_ids) < len(prompts), [r.status_code for r in rs]
        for r in failed:
            assert r.json()["error"]["code"] == "engine_error", r.text
            assert "other requests are unaffected" in assert_error_shape(r, CMPL)
        for p, r in zip(prompts, rs):
            if r.status_code != 500:
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == expect[p], r.text
        assert engine.num_failed_steps == failed_before + 1
        # a stream whose first step fails gets the 500 itself; one that fails later, after
        # tokens went out, ends with an error event and [DONE]
        for skip in (0, 3):
            hook.arm(skip)
            body = {**BASE[CMPL], "stream": True, "max_tokens": 10, "ignore_eos": True}
            with server.http.stream("POST", CMPL, json=body) as r:
                status, events = r.status_code, sse_events(list(r.iter_lines()))
            if skip == 0:
                assert status == 500 and not events
            else:
                assert status == 200 and any(e != "[DONE]" and "choices" in e for e in events), events
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error", events
        assert server.app.state.jx.internal_errors == 0
    finally:
        engine.fault_hook = None
    assert_serving_and_idle(server)
    assert 'jaxinfer:num_failed_steps_total{model_name="%s"} %s' % (MODEL_NAME, float(engine.num_failed_steps)) \
        in server.http.get("/metrics").text


def test_a_failed_step_frees_pages_in_flight_mid_generation(server):
    """The fault comes while requests are decoding (pages held, prefix pages cached)."""
    engine = server.aeng.engine
    calls = [0]

    def hook(sched):
        calls[0] += 1
        if calls[0] == 4:
            raise ValueError("injected fault in the fourth step")

    engine.fault_hook = hook
    try:
        r = post(server, CMPL, {**BASE[CMPL], "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    finally:
        engine.fault_hook = None
    engine.block_manager.check_invariants()
    assert_serving_and_idle(server)


# ------------------------------------------------------------- a lost device ends the process

def test_lost_device_state_fails_in_flight_and_the_server_exits_nonzero():
    with server_process(None, "--shutdown-timeout", "5", "--lose-device-at-step", "3") as (proc, url):
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + CMPL, json=body, timeout=60) as r:
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events
        assert proc.wait(timeout=60) == 1
        out = proc.stdout.read()
        assert "the engine has stopped" in out and "exiting" in out, out[-2000:]


def test_tokens_queued_before_the_engine_died_reach_the_stream_first():
    """The overlapped loop delivers step N's tokens and, a moment later, the death of step
    N+1: when both are queued before the caller wakes, the caller still gets the tokens
    (then the error), not the error alone (a stream that ended with no event at all)."""
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.errors import EngineDeadError
    from jaxinfer.outputs import CompletionOutput, RequestOutput

    idle = SimpleNamespace(tokenizer=None, model_name="m", max_model_len=64,
                           config=SimpleNamespace(max_num_seqs=1, max_queue_delay_ms=None,
                                                  scheduling_policy="fcfs"), has_unfinished=lambda: False,
                           add_request=lambda *a, **kw: None, abort=lambda rid: None,
                           encode_prompt=lambda p: (None, list(p)))
    aeng = AsyncEngine(idle)

    async def run():
        agen = aeng.generate([1, 2], SamplingParams(max_tokens=4), "r")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.1)                   # the request posted; the caller waits on its queue
        assert not first.done() and "r" in aeng._queues
        q = aeng._queues["r"][1]
        q.put_nowait(RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [7])]))
        q.put_nowait(EngineDeadError("the engine has stopped: RuntimeError"))
        out = await first
        assert out.outputs[0].token_ids == [7]
        with pytest.raises(EngineDeadError):
            await agen.__anext__()

    try:
        asyncio.run(run())
    finally:
        asyncio.run(aeng.shutdown())


def test_sampling_params_bounds_are_closed():
    """Every numeric SamplingParams field has both ends: an open end is how 2**31 reached an
    int32 array and 1e308 a float power."""
    for name, bound in SamplingParams.BOUNDS.items():
        assert bound.lo is not None and bound.hi is not None, name
    for bad in (dict(top_k=2**31), dict(length_penalty=11.0), dict(n=10**6), dict(max_tokens=2**31),
                dict(seed=2**63), dict(stop_token_ids=[2**31]), dict(temperature=1e308)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)

